-- room_admit.lua — admit the next tickets (after close_prequeue), at the
-- room's rate, from whichever instance calls: the bucket and the places
-- being served are here, so two admitters never admit a ticket twice nor
-- together exceed admit_per_sec.
--
-- KEYS[1] room   KEYS[2] states   KEYS[3] active   KEYS[4] offers
-- ARGV[1] now (ms, sale clock)   ARGV[2] the place the caller read as the
-- next (`serving`, or `offering` once sold out)   ARGV[3] units Redis
-- holds for sale now   ARGV[4] the share of the room's rate the order
-- pipeline takes now, in thousandths (adaptive admission; 1000: all)
-- ARGV[5] how many more orders the pipeline may have in flight (adaptive
-- admission; -1: no limit), before the passes this room gave out in the
-- last ARGV[6] ms and not used yet, which may still buy, are counted
-- ARGV[7] the room's `taken` as the caller read it before it read ARGV[3]
-- ARGV[8..] the tickets at places ARGV[2], ARGV[2] + 1, … (the caller
--           computes them from the draw)
--
-- Once the units are gone the room is sold out for good. Every ticket that
-- has not bought is on the waitlist, admitted or not (an admitted pass no
-- longer buys; a used one whose purchase lost the last race, `U:`, is
-- there too), and each unit that comes back is offered, one open offer
-- per unit, to the next of them in queue order: a second pointer,
-- `offering`, walks the order from its start. A ticket that bought (`B:`,
-- `D:`, marked by room_bought.lua) is passed over.
--
-- Returns {-1} no room, {-2} the sale is over, {-3, place} the caller's
-- place is stale, {0, serving} before the start, else {1, place, sold,
-- seq, passes outstanding, offers open, offers expired unused, the window
-- left (-1: no limit), tickets…}.
local now = tonumber(ARGV[1])
local r = redis.call('HMGET', KEYS[1], 'end_ms', 'seq', 'serving', 'sold', 'rate',
  'max_active', 'pass_ms', 'offer_ms', 'tokens_m', 'tokens_at', 'offering')
if not r[1] then return {-1} end
if not close_prequeue(KEYS[1], now) then return {0, tonumber(r[3])} end
-- Closing the pre-queue just now emptied the bucket.
r[9], r[10] = unpack(redis.call('HMGET', KEYS[1], 'tokens_m', 'tokens_at'))
if now >= tonumber(r[1]) then return {-2} end
local sold = r[4] == '1'
local field = 'serving'
if sold then field = 'offering' end
local place = tonumber(redis.call('HGET', KEYS[1], field))
if place ~= tonumber(ARGV[2]) then return {-3, place} end

-- Passes and offers past their time. Once sold out an admitted pass
-- stays as it is: its ticket is waitlisted, not expired.
local lapsed = 0
for _, t in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)) do
  local kind = string.sub(redis.call('HGET', KEYS[2], t) or '', 1, 1)
  if kind == 'O' then
    redis.call('HSET', KEYS[2], t, 'E')
    lapsed = lapsed + 1
  elseif kind == 'A' and not sold then
    redis.call('HSET', KEYS[2], t, 'E')
  end
end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)

local avail = tonumber(ARGV[3])
local rate = math.floor(tonumber(r[5]) * math.min(1000, math.max(0, tonumber(ARGV[4]))) / 1000)
-- The bucket refills on Redis's clock, the same for every instance (each
-- one's sale clock differs: refilled from each caller's own "now", two
-- instances 2 s apart admitted several times the rate). The refill time
-- only moves forward, should Redis's clock step back (a failover).
local tokens_at = math.max(tonumber(r[10]), bucket_clock())
local tokens = tonumber(r[9]) + (tokens_at - tonumber(r[10])) * rate
if tokens > rate * 1000 then tokens = rate * 1000 end
local n = math.floor(tokens / 1000)
local active = redis.call('ZCARD', KEYS[3])
local offers = redis.call('ZCARD', KEYS[4])
if not sold and avail <= 0 then
  -- Sold out now: this round's candidates are for the other pointer.
  redis.call('HSET', KEYS[1], 'sold', '1')
  sold, n = true, 0
elseif sold then
  -- The units were read before this script: an offer bought since then
  -- left the offers here, while its unit may still be in ARGV[3]. Each
  -- purchase marked bought since counts as gone (one read before its
  -- reservation counts twice, and waits for the next round): without it a
  -- round offered a unit just sold, to a ticket that could not buy it.
  local taken = tonumber(redis.call('HGET', KEYS[1], 'taken') or '0') - tonumber(ARGV[7])
  n = math.min(n, avail - math.max(0, taken) - offers)
elseif tonumber(r[6]) > 0 then
  n = math.min(n, tonumber(r[6]) - active)
end
-- The window: each pass may become an order. Those given out lately and
-- not used are not in the lag yet (those used lately the caller counted).
local window = tonumber(ARGV[5])
if window >= 0 then
  local fresh = redis.call('ZCOUNT', KEYS[3], '(' .. (now + tonumber(r[7]) - tonumber(ARGV[6])), '+inf')
  window = math.max(0, window - fresh)
  n = math.min(n, window)
end

local seq = tonumber(r[2])
local out = {}
local i = 8
while n > 0 and i <= #ARGV do
  local t = ARGV[i]
  if tonumber(t) > seq then break end
  i = i + 1
  place = place + 1
  local st = redis.call('HGET', KEYS[2], t)
  local kind, exp
  if not st then
    kind, exp = 'A', now + tonumber(r[7])
    if sold then kind, exp = 'O', now + tonumber(r[8]) end
  elseif sold and (string.sub(st, 1, 2) == 'A:' or string.sub(st, 1, 2) == 'U:') then
    kind, exp = 'O', now + tonumber(r[8])
  end
  if kind then
    redis.call('HSET', KEYS[2], t, kind .. ':' .. string.format('%d', exp))
    redis.call('ZADD', KEYS[3], exp, t)
    if sold then redis.call('ZADD', KEYS[4], exp, t) end
    out[#out + 1] = t
    n = n - 1
  end
end
-- The window left after this round (-1: no limit), for the operator.
local left = -1
if window >= 0 then left = window - #out end
redis.call('HSET', KEYS[1], field, place, 'tokens_at', string.format('%d', tokens_at),
  'tokens_m', string.format('%d', tokens - #out * 1000), 'rate_now', rate,
  'window_now', left)
redis.call('HINCRBY', KEYS[1], 'admitted', #out)
local flag = 0
if sold then flag = 1 end
local reply = {1, place, flag, seq, redis.call('ZCARD', KEYS[3]), redis.call('ZCARD', KEYS[4]),
  lapsed, left}
for _, t in ipairs(out) do reply[#reply + 1] = tonumber(t) end
return reply

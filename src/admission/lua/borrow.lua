-- borrow.lua — the home shard takes in units another shard lent it, once
-- per transfer (docs/HOT_ACTIVITY.md), step 2 of 3. Also run by the
-- reconciler for a transfer whose lender outlived its borrower.
--
-- KEYS[1] this shard's credited marker of the transfer
-- KEYS[2] this shard's dry marker   KEYS[3..] this shard's stock buckets
-- ARGV[1] units   ARGV[2] first bucket (0-based)
--
-- Returns 1 when credited now, 0 when this transfer was credited before.
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', 604800) then return 0 end
local n = #KEYS - 2
local units, first = tonumber(ARGV[1]), tonumber(ARGV[2]) % n
local base, extra = math.floor(units / n), units % n
for i = 0, n - 1 do
  local v = base
  if i < extra then v = v + 1 end
  if v > 0 then redis.call('INCRBY', KEYS[3 + (first + i) % n], v) end
end
redis.call('DEL', KEYS[2])
return 1

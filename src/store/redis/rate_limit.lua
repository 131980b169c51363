-- Rate limiting: every strategy, every operation, one call. A port of the integer maths of
-- src/rate_limit/{strategy,emission,gcra,leaky,token_bucket,fixed_window,sliding_window,
-- algebra}.rs; keep them in step.
--
-- KEYS[1]  the key's state: "<kinds> <field> <field> ..." (one kind letter per tier)
-- ARGV[1]  pinned time in ms, or '' for the server's TIME (now_ms comes from the prelude)
-- ARGV[2]  op: c check, r reserve, p peek, f forecast, x reset
-- ARGV[3]  cost
-- ARGV[4]  milliseconds the key outlives its state's rest point (server time: 1; pinned: more)
-- ARGV[5]  number of tiers; then per tier 5 values: kind, limit, a, b, c
--          g gcra / l shaper: period_us, per, tolerance
--          t token bucket:    capacity, per_us, refill
--          f fixed / s sliding window: window_us, 0, 0
--
-- Every number stays an integer below 2^53 (the caller checks each tier's horizon), so Lua
-- doubles compute exactly what the u64 maths does. Division goes through fmod, which is exact.
-- Replies: {1, allowed, limit, remaining, reset_at_ms, retry_after_ms} a decision,
-- {2, spendable_now, next_replenish_at_ms, full_at_ms} a forecast, {3, 1, delay_ms} or
-- {3, 0, retry_after_ms} a reservation, {4} a reset.

local CEIL = 4000000000000000

local function idiv(a, b)
  local r = math.fmod(a, b)
  return (a - r) / b, r
end
local function dceil(a, b)
  local q, r = idiv(a, b)
  if r > 0 then q = q + 1 end
  return q
end
local function ssub(a, b)
  if a > b then return a - b end
  return 0
end
local function ms_up(us) return dceil(us, 1000) end
local function max(a, b) if a > b then return a end return b end
local function min(a, b) if a < b then return a end return b end

local FIELDS = {g = 2, l = 2, t = 2, f = 2, s = 3}

local function view(t, s, now)
  local k = t.k
  if k == 'g' or k == 'l' then
    if s and (s[1] > now or (s[1] == now and s[2] > 0)) then return {s[1], s[2]} end
    return {now, 0}
  elseif k == 't' then
    local full = t.a * t.b
    if not s then return {full, now} end
    if now <= s[2] then return {s[1], s[2]} end
    local missing = ssub(full, s[1])
    local elapsed = now - s[2]
    if elapsed * t.c >= missing then return {full, now} end
    return {s[1] + elapsed * t.c, now}
  elseif k == 'f' then
    local start = now - math.fmod(now, t.a)
    if s and s[1] >= start then return {s[1], s[2]} end
    return {start, 0}
  else
    local w = t.a
    local start = now - math.fmod(now, w)
    if s and s[1] >= start then return {s[1], s[2], s[3]} end
    if s and s[1] + w == start then return {start, s[3], 0} end
    return {start, 0, 0}
  end
end

local function available(t, v, now)
  local k = t.k
  if k == 'g' or k == 'l' then
    local ahead = ssub(v[1], now) * t.b + v[2]
    return (idiv(ssub(t.c, ahead), t.a))
  elseif k == 't' then
    return (idiv(v[1], t.b))
  elseif k == 'f' then
    return ssub(t.limit, v[2])
  else
    local w = t.a
    local est = v[2] * (w - min(ssub(now, v[1]), w)) + v[3] * w
    return (idiv(ssub(t.limit * w, est), w))
  end
end

local function earliest(t, v, now, units)
  local k = t.k
  local at
  if k == 'g' or k == 'l' then
    local need = v[2] + units * t.a
    if need <= t.c then
      at = ssub(v[1], (idiv(t.c - need, t.b)))
    else
      at = v[1] + dceil(need - t.c, t.b)
    end
  elseif k == 't' then
    local need = units * t.b
    if v[1] >= need then return now end
    at = v[2] + dceil(need - v[1], t.c)
  elseif k == 'f' then
    if v[2] + units <= t.limit then return now end
    at = v[1] + t.a
  else
    local w = t.a
    local budget = ssub(t.limit, units) * w
    local current = v[3] * w
    if current <= budget then
      if v[2] == 0 then return now end
      local slack = idiv(budget - current, v[2])
      at = v[1] + (w - min(slack, w))
    else
      at = ssub(v[1] + 2 * w, min((idiv(budget, v[3])), w))
    end
  end
  return max(at, now)
end

local function consume(t, v, units)
  local k = t.k
  if k == 'g' or k == 'l' then
    local q, r = idiv(v[2] + units * t.a, t.b)
    local us = v[1] + q
    if r > 0 then return {us, r}, us + 1 end
    return {us, r}, us
  elseif k == 't' then
    local level = v[1] - units * t.b
    return {level, v[2]}, v[2] + dceil(t.a * t.b - level, t.c)
  elseif k == 'f' then
    return {v[1], v[2] + units}, v[1] + t.a
  else
    return {v[1], v[2], v[3] + units}, v[1] + 2 * t.a
  end
end

local function delay(t, v, now)
  if t.k ~= 'l' then return 0 end
  local d = ssub(v[1], now)
  if v[2] > 0 then d = d + 1 end
  return d
end

local function denied(t, v, now, now_ms, avail, cost)
  return {0, t.limit, avail, ms_up(earliest(t, v, now, t.limit)),
    ssub(ms_up(earliest(t, v, now, cost)), now_ms)}
end

-- The consuming transition: allowed?, decision, next state, ttl ms, reservation delay ms.
local function step(t, s, now, now_ms, units)
  local v = view(t, s, now)
  local avail = available(t, v, now)
  if avail < units then return false, denied(t, v, now, now_ms, avail, units) end
  local wait = ms_up(delay(t, v, now))
  local nxt, full_at = consume(t, v, units)
  local reset = ms_up(full_at)
  return true, {1, t.limit, avail - units, reset, 0}, nxt, ssub(reset, now_ms), wait
end

local function peek(t, s, now, now_ms)
  local v = view(t, s, now)
  local avail = available(t, v, now)
  if avail >= 1 then return {1, t.limit, avail, ms_up(earliest(t, v, now, t.limit)), 0} end
  return denied(t, v, now, now_ms, avail, 1)
end

local function forecast(t, s, now, cost)
  local v = view(t, s, now)
  local avail = available(t, v, now)
  local nxt = now
  if avail < t.limit then nxt = earliest(t, v, now, avail + 1) end
  return {(idiv(avail, cost)), ms_up(nxt), ms_up(earliest(t, v, now, t.limit))}
end

local function combine(a, b)
  return {min(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3]), max(a[4], b[4]), max(a[5], b[5])}
end

-- Arguments.
local op = ARGV[2]
local n = tonumber(ARGV[5])
local tiers, kinds = {}, {}
for i = 1, n do
  local base = 5 + (i - 1) * 5
  local t = {k = ARGV[base + 1], limit = tonumber(ARGV[base + 2]),
    a = tonumber(ARGV[base + 3]), b = tonumber(ARGV[base + 4]), c = tonumber(ARGV[base + 5])}
  tiers[i] = t
  kinds[i] = t.k
end
local sig = table.concat(kinds)

if op == 'x' then
  redis.call('DEL', KEYS[1])
  return {4}
end

local cost = tonumber(ARGV[3])
local now_in = now_ms(ARGV[1])
local now = min(now_in * 1000, CEIL)
local nms = (idiv(now, 1000))

-- The stored state, one table per tier (nil: none).
local states = {}
local raw = redis.call('GET', KEYS[1])
if raw then
  local it = string.gmatch(raw, '%S+')
  if it() ~= sig then
    return redis.error_reply('rate limit key ' .. KEYS[1] .. ' holds the state of another strategy')
  end
  for i = 1, n do
    local s = {}
    for j = 1, FIELDS[tiers[i].k] do s[j] = tonumber(it()) end
    states[i] = s
  end
end

local function store(nexts, ttl)
  local parts = {sig}
  for i = 1, n do
    for _, x in ipairs(nexts[i]) do parts[#parts + 1] = string.format('%.0f', x) end
  end
  redis.call('SET', KEYS[1], table.concat(parts, ' '), 'PX',
    string.format('%.0f', ttl + tonumber(ARGV[4])))
end

if n == 1 then
  local t, s = tiers[1], states[1]
  if op == 'c' or op == 'r' then
    local ok, d, nxt, ttl, wait = step(t, s, now, nms, cost)
    if ok then store({nxt}, ttl) end
    if op == 'c' then return {1, d[1], d[2], d[3], d[4], d[5]} end
    if ok then return {3, 1, wait} end
    return {3, 0, d[5]}
  elseif op == 'p' then
    local d = peek(t, s, now, nms)
    return {1, d[1], d[2], d[3], d[4], d[5]}
  else
    local f = forecast(t, s, now, cost)
    return {2, f[1], f[2], f[3]}
  end
end

-- Several tiers: all-or-nothing.
local d
if op == 'c' or op == 'r' then
  local all, oks, ds, nexts, ttl = true, {}, {}, {}, 0
  for i = 1, n do
    local ok, di, nxt, ti = step(tiers[i], states[i], now, nms, cost)
    oks[i], ds[i], nexts[i] = ok, di, nxt
    if ok then ttl = max(ttl, ti) else all = false end
  end
  for i = 1, n do
    local di = ds[i]
    if not all and oks[i] then di = peek(tiers[i], states[i], now, nms) end
    if d then d = combine(d, di) else d = di end
  end
  if all then store(nexts, ttl) end
  if op == 'r' then
    if d[1] == 1 then return {3, 1, 0} end
    return {3, 0, d[5]}
  end
elseif op == 'p' then
  for i = 1, n do
    local di = peek(tiers[i], states[i], now, nms)
    if d then d = combine(d, di) else d = di end
  end
else
  local spend, nxt, full
  for i = 1, n do
    local f = forecast(tiers[i], states[i], now, cost)
    if not spend or f[1] < spend then
      spend, nxt = f[1], f[2]
    elseif f[1] == spend then
      nxt = max(nxt, f[2])
    end
    full = max(full or 0, f[3])
  end
  return {2, spend, nxt, full}
end
return {1, d[1], d[2], d[3], d[4], d[5]}

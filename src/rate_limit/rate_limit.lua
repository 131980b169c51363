-- Rate limiting: every strategy, every operation, one call. A port of the integer maths of
-- src/rate_limit/{strategy,emission,gcra,leaky,token_bucket,fixed_window,sliding_window,
-- algebra}.rs; keep them in step (tests/redis_rate_limit.rs compares every reply).
--
-- This file is the library: `now_us` reads the time (the server's `TIME`, to the microsecond, as
-- the Rust clocks read it), `params` reads an operation's arguments once, `decide` runs one
-- operation on a key's state read by its caller. The store appends the entry point
-- (src/store/redis/rate_limit.rs): one operation per call (`GET`, then `decide`), or several
-- keys' operations in one call at one `TIME` (a batch): one `MGET` for all their states,
-- operations with the same arguments (one limiter's checks) sharing one parsed set, and an
-- operation seeing what an earlier one of the batch wrote to its key (`written`).
--
-- A key holds its state: its kinds (one letter per tier; g gcra, l leaky shaper, t token
-- bucket, f fixed window, s sliding window), then each tier's fields (two; three for s), then
-- its rest time (µs), as little-endian doubles, exact since every value is an integer below
-- 2^53. `struct.pack` and `unpack` cost the server a third of what formatting and matching
-- the same fields as text did. The rest time is when the state is at rest under the limits
-- that wrote it: from then on it reads as no state, whatever limits read it (an override may
-- read it with others), exactly as the memory store reads it. A state written by 0.2 has no
-- rest time; its key's expiry stands for it.
-- An operation's arguments, from ARGV[o]:
--   op     c check, r reserve, p peek, f forecast, x reset (then only its channel: the script
--          publishes the key there, for the instances that answer its denials locally)
--   cost
--   slack  ms the key outlives its state's rest point (server time: 1; pinned: more)
--   kinds  one letter per tier (also the stored signature)
--   then per tier 4 values: limit, a, b, c
--          g, l: period_us, per, tolerance     t: capacity, per_us, refill
--          f, s: window_us, 0, 0
--
-- Every number stays an integer below 2^53 (the caller checks each tier's horizon), so Lua
-- doubles compute exactly what the u64 maths does; divisions go through `mod`, which is exact,
-- and '%d' prints them exactly (Lua 5.1 formats it as a C long); `struct.pack('d')` stores
-- them exactly. Every value divided is at least 0.
-- Subtractions the Rust code saturates are clamped at 0 here. No tables or closures are made
-- per tier, since a script's cost is mostly allocation.
-- Replies, written by `decide` into a flat table from a given index (one table per call, not
-- one per operation): 1, allowed, limit, remaining, reset_at_ms, retry_after_ms a decision;
-- 2, spendable_now, next_replenish_at_ms, full_at_ms a forecast; 3, 1, delay_ms or
-- 3, 0, retry_after_ms a reservation; 4 a reset; 5 a key holding another strategy's state
-- (or, read in a batch, a value of another type).

-- x mod y, exact for integers x >= 0, y > 0 below 2^53. Lua's `%` is x - floor(x / y) * y,
-- whose terms are exact, but x / y may round up to the next integer, leaving x - y < r < 0:
-- corrected here (inline where it is hot: a Lua call costs more than the maths). A third of
-- the cost of `math.fmod`, which divides bit by bit.
local function mod(x, y)
  local r = x % y
  if r < 0 then return r + y end
  return r
end

local function idiv(x, y)
  local r = x % y
  if r < 0 then r = r + y end
  return (x - r) / y
end

local function dceil(x, y)
  local r = x % y
  if r < 0 then r = r + y end
  if r > 0 then return (x - r) / y + 1 end
  return x / y
end

-- The earliest µs >= now at which `units` are spendable, from the view (v1, v2, v3).
local function earliest(k, lim, a, b, c, v1, v2, v3, now, units)
  local at
  if k == 'g' or k == 'l' then
    local need = v2 + units * a
    if need <= c then
      at = v1 - idiv(c - need, b)
    else
      at = v1 + dceil(need - c, b)
    end
  elseif k == 't' then
    local need = units * b
    if v1 >= need then return now end
    at = v2 + dceil(need - v1, c)
  elseif k == 'f' then
    if v2 + units <= lim then return now end
    at = v1 + a
  else
    local budget = lim - units
    if budget < 0 then budget = 0 end
    budget = budget * a
    local current = v3 * a
    if current <= budget then
      if v2 == 0 then return now end
      local slack = idiv(budget - current, v2)
      if slack > a then slack = a end
      at = v1 + (a - slack)
    else
      local back = idiv(budget, v3)
      if back > a then back = a end
      at = v1 + 2 * a - back
    end
  end
  if at < now then return now end
  return at
end

-- One tier: op 'f' returns a forecast (3 values); 'p' a decision (5); 'c'/'r' a decision and,
-- when allowed, the next state, its ttl in ms, the reservation delay in ms and its rest time
-- in µs (11).
local function run(op, k, lim, a, b, c, has, s1, s2, s3, now, units)
  -- The state brought forward to now.
  local v1, v2, v3 = now, 0, 0
  if k == 'g' or k == 'l' then
    -- A fraction written with a larger `per` (an override) is read as a whole microsecond.
    if has and s2 >= b then s1, s2 = s1 + 1, 0 end
    if has and (s1 > now or (s1 == now and s2 > 0)) then v1, v2 = s1, s2 end
  elseif k == 't' then
    local full = a * b
    if not has then
      v1, v2 = full, now
    elseif now <= s2 then
      -- Capped at the capacity: a state written with a larger one (an override) holds no more.
      v1, v2 = s1, s2
      if v1 > full then v1 = full end
    else
      local missing = full - s1
      if missing < 0 then missing = 0 end
      local elapsed = now - s2
      if elapsed * c >= missing then v1, v2 = full, now else v1, v2 = s1 + elapsed * c, now end
    end
  else
    local start = now - mod(now, a)
    if has and s1 >= start then
      v1, v2, v3 = s1, s2, s3
    elseif k == 's' and has and s1 + a == start then
      v1, v2, v3 = start, s3, 0
    else
      v1 = start
    end
  end
  -- Units spendable now.
  local avail
  if k == 'g' or k == 'l' then
    local ahead = v1 - now
    if ahead < 0 then ahead = 0 end
    local room = c - (ahead * b + v2)
    if room < 0 then room = 0 end
    local r = room % a
    if r < 0 then r = r + a end
    avail = (room - r) / a
  elseif k == 't' then
    avail = idiv(v1, b)
  elseif k == 'f' then
    avail = lim - v2
    if avail < 0 then avail = 0 end
  else
    local elapsed = now - v1
    if elapsed < 0 then elapsed = 0 end
    if elapsed > a then elapsed = a end
    local room = lim * a - (v2 * (a - elapsed) + v3 * a)
    if room < 0 then room = 0 end
    avail = idiv(room, a)
  end
  if op == 'f' or op == 'p' or avail < units then
    -- When the tier is full again; not needed by an allowed check, the hot path.
    local full_ms = dceil(earliest(k, lim, a, b, c, v1, v2, v3, now, lim), 1000)
    if op == 'f' then
      local nxt = now
      if avail < lim then nxt = earliest(k, lim, a, b, c, v1, v2, v3, now, avail + 1) end
      return idiv(avail, units), dceil(nxt, 1000), full_ms
    end
    if avail < units then
      -- How long from now (earliest is never before it), rounded up to whole ms.
      local retry = dceil(earliest(k, lim, a, b, c, v1, v2, v3, now, units) - now, 1000)
      return 0, lim, avail, full_ms, retry
    end
    return 1, lim, avail, full_ms, 0
  end
  -- Spend.
  local wait = 0
  if k == 'l' then
    wait = v1 - now
    if wait < 0 then wait = 0 end
    if v2 > 0 then wait = wait + 1 end
    wait = dceil(wait, 1000)
  end
  local full_at
  if k == 'g' or k == 'l' then
    local total = v2 + units * a
    local r = total % b
    if r < 0 then r = r + b end
    v1, v2 = v1 + (total - r) / b, r
    full_at = v1
    if r > 0 then full_at = v1 + 1 end
  elseif k == 't' then
    v1 = v1 - units * b
    full_at = v2 + dceil(a * b - v1, c)
  elseif k == 'f' then
    v2 = v2 + units
    full_at = v1 + a
  else
    v3 = v3 + units
    full_at = v1 + 2 * a
  end
  -- dceil(full_at, 1000) and dceil(full_at - now, 1000), inline.
  local r = full_at % 1000
  if r < 0 then r = r + 1000 end
  local reset = (full_at - r) / 1000
  if r > 0 then reset = reset + 1 end
  local left = full_at - now
  if left < 0 then left = 0 end
  r = left % 1000
  if r < 0 then r = r + 1000 end
  local ttl = (left - r) / 1000
  if r > 0 then ttl = ttl + 1 end
  return 1, lim, avail - units, reset, 0, v1, v2, v3, ttl, wait, full_at
end

-- An operation's arguments from ARGV[o] onwards (op, cost, slack, kinds, then 4 numbers per
-- tier, as described above), parsed: {op, units, slack, kinds, numbers...} with the numbers
-- from index 5.
local function params(o)
  local op = ARGV[o]
  if op == 'x' then return {op, ARGV[o + 1]} end
  local kinds = ARGV[o + 3]
  local p = {op, tonumber(ARGV[o + 1]), tonumber(ARGV[o + 2]), kinds}
  for i = 1, 4 * #kinds do p[4 + i] = tonumber(ARGV[o + 3 + i]) end
  return p
end

-- What this call wrote to each key (false: deleted), so that in a batch an operation sees
-- what an earlier one did to the same key.
local written = {}

-- In a batch (set by its entry point), the writes that wait for its end: the keys in order,
-- and for each the ms its last state must live. A key that already holds a state of this
-- library takes a plain `SET`, which cannot fail, so the operations of a batch on one key
-- (a hot key: a global limit, one tenant's) write it once, with what the last one left.
local deferred, deferred_keys = nil, nil

-- Writes `value` as the state of `key` for `px` ms; `fresh` when the key had no state, so the
-- write is `NX`: a key that `MGET` read as empty but holds a value of another type is left
-- alone, and `false` returned. In a batch, a write to a key with a state waits for its end.
local function store(key, value, px, fresh)
  if deferred and not fresh then
    if not deferred[key] then deferred_keys[#deferred_keys + 1] = key end
    deferred[key] = px
    written[key] = value
    return true
  end
  local ms = string.format('%d', px)
  local done
  if fresh then
    done = redis.call('SET', key, value, 'PX', ms, 'NX')
  else
    done = redis.call('SET', key, value, 'PX', ms)
  end
  if not done then return false end
  written[key] = value
  return true
end

-- The fields of a state `raw` written for `kinds` (see the top) and its rest time (nil for a
-- state written without one), or nil when it holds the state of other kinds, or no state of
-- this library.
local function fields_of(raw, kinds)
  local n = #kinds
  local count = 0
  for t = 1, n do
    if string.sub(kinds, t, t) == 's' then count = count + 3 else count = count + 2 end
  end
  if string.sub(raw, 1, n) ~= kinds then return nil end
  local stored = count
  if #raw == n + 8 * (count + 1) then
    stored = count + 1
  elseif #raw ~= n + 8 * count then
    return nil
  end
  local values = {struct.unpack('<' .. string.rep('d', stored), raw, n + 1)}
  local rest = nil
  if stored > count then rest = values[stored] end
  values[stored + 1] = nil
  values[count + 1] = nil
  return values, rest
end

-- The server's time in µs (`TIME`: seconds and microseconds, exact as a double until 2255), or
-- the time a test pinned, in µs, when `pinned` is not empty.
local function now_us(pinned)
  if pinned ~= nil and pinned ~= '' then return tonumber(pinned) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- The time of a call in µs, capped as the Rust strategies cap it.
local function clock(t_us)
  if t_us > 4000000000000000 then return 4000000000000000 end
  return t_us
end

-- One operation on `key`, whose state is `raw` (false when it has none), at `now` µs, with the
-- parsed arguments `p` (from `params`). Writes its reply into `out` from index `i` and returns
-- the index after it.
local function decide(key, p, now, raw, out, i)
  local op = p[1]
  if op == 'x' then
    redis.call('DEL', key)
    -- Instances answering this key's denials locally forget them (p[2]: the channel).
    -- pcall: a notice refused (no channel rights) must not fail the script after its write.
    if p[2] and p[2] ~= '' then redis.pcall('PUBLISH', p[2], key) end
    written[key] = false
    if deferred then deferred[key] = nil end
    out[i] = 4
    return i + 1
  end
  local units, slack, kinds = p[2], p[3], p[4]
  local n = #kinds

  if n == 1 then
    local k = kinds
    local lim, a, b, c = p[5], p[6], p[7], p[8]
    local has, s1, s2, s3 = false, 0, 0, 0
    if raw then
      -- One tier: its kind, then two fields (three for s), then its rest time (but in a
      -- state written by 0.2).
      local rest = nil
      if string.sub(raw, 1, 1) == k then
        if k == 's' then
          if #raw == 33 then
            has, s1, s2, s3, rest = true, struct.unpack('<dddd', raw, 2)
          elseif #raw == 25 then
            has, s1, s2, s3 = true, struct.unpack('<ddd', raw, 2)
          end
        elseif #raw == 25 then
          has, s1, s2, rest = true, struct.unpack('<ddd', raw, 2)
        elseif #raw == 17 then
          has, s1, s2 = true, struct.unpack('<dd', raw, 2)
        end
      end
      if not has then
        out[i] = 5
        return i + 1
      end
      -- At rest under the limits that wrote it: no state.
      if rest and rest <= now then has = false end
    end
    if op == 'f' then
      local spend, nxt, full = run(op, k, lim, a, b, c, has, s1, s2, s3, now, units)
      out[i], out[i + 1], out[i + 2], out[i + 3] = 2, spend, nxt, full
      return i + 4
    end
    local allowed, l, rem, reset, retry, n1, n2, n3, ttl, wait, rest =
      run(op, k, lim, a, b, c, has, s1, s2, s3, now, units)
    if allowed == 1 and op ~= 'p' then
      local value
      if k == 's' then
        value = struct.pack('<c1dddd', k, n1, n2, n3, rest)
      else
        value = struct.pack('<c1ddd', k, n1, n2, rest)
      end
      if not store(key, value, ttl + slack, not raw) then
        out[i] = 5
        return i + 1
      end
    end
    if op ~= 'r' then
      out[i], out[i + 1], out[i + 2], out[i + 3], out[i + 4], out[i + 5] =
        1, allowed, l, rem, reset, retry
      return i + 6
    end
    out[i], out[i + 1] = 3, allowed
    if allowed == 1 then out[i + 2] = wait else out[i + 2] = retry end
    return i + 3
  end

  -- Several tiers, all-or-nothing: charged together, or none is and the decision combines the
  -- denials with what the other tiers would report as they stand.
  -- Three fields per tier (a third of 0 for kinds that keep two).
  local fields = {}
  local has = raw and true or false
  if raw then
    local values, rest = fields_of(raw, kinds)
    if not values then
      out[i] = 5
      return i + 1
    end
    -- At rest under the limits that wrote it: no state.
    if rest and rest <= now then has = false end
    local v = 1
    for t = 1, n do
      fields[#fields + 1], fields[#fields + 2] = values[v], values[v + 1]
      v = v + 2
      if string.sub(kinds, t, t) == 's' then
        fields[#fields + 1] = values[v]
        v = v + 1
      else
        fields[#fields + 1] = 0
      end
    end
  end

  local function tier(t, tier_op)
    local base = 4 * t
    local f = 3 * (t - 1)
    return run(tier_op, string.sub(kinds, t, t), p[base + 1], p[base + 2], p[base + 3], p[base + 4],
      has, fields[f + 1], fields[f + 2], fields[f + 3], now, units)
  end

  if op == 'f' then
    local spend, nxt, full
    for t = 1, n do
      local s, x, y = tier(t, 'f')
      if not spend or s < spend then
        spend, nxt = s, x
      elseif s == spend and x > nxt then
        nxt = x
      end
      if not full or y > full then full = y end
    end
    out[i], out[i + 1], out[i + 2], out[i + 3] = 2, spend, nxt, full
    return i + 4
  end

  -- Combines a decision into (A, L, R, S, T): allowed and, limits and remaining min, reset and
  -- retry max.
  local A, L, R, S, T
  local function fold(allowed, l, rem, reset, retry)
    if not A then
      A, L, R, S, T = allowed, l, rem, reset, retry
      return
    end
    if allowed < A then A = allowed end
    if l < L then L = l end
    if rem < R then R = rem end
    if reset > S then S = reset end
    if retry > T then T = retry end
  end

  if op == 'p' then
    for t = 1, n do fold(tier(t, 'p')) end
  else
    local results, parts, ttl, rest, all = {}, {}, 0, 0, true
    for t = 1, n do
      local allowed, l, rem, reset, retry, n1, n2, n3, tl, _, tr = tier(t, 'c')
      results[t] = {allowed, l, rem, reset, retry}
      if allowed == 1 then
        if tl > ttl then ttl = tl end
        if tr > rest then rest = tr end
        parts[#parts + 1], parts[#parts + 2] = n1, n2
        if string.sub(kinds, t, t) == 's' then parts[#parts + 1] = n3 end
      else
        all = false
      end
    end
    for t = 1, n do
      local d = results[t]
      if all or d[1] == 0 then
        fold(d[1], d[2], d[3], d[4], d[5])
      else
        fold(tier(t, 'p'))
      end
    end
    if all then
      parts[#parts + 1] = rest
      local value = kinds .. struct.pack('<' .. string.rep('d', #parts), unpack(parts))
      if not store(key, value, ttl + slack, not raw) then
        out[i] = 5
        return i + 1
      end
    end
    if op == 'r' then
      out[i], out[i + 1] = 3, A
      if A == 1 then out[i + 2] = 0 else out[i + 2] = T end
      return i + 3
    end
  end
  out[i], out[i + 1], out[i + 2], out[i + 3], out[i + 4], out[i + 5] = 1, A, L, R, S, T
  return i + 6
end

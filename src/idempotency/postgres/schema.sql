BEGIN;
SET LOCAL client_min_messages = warning;
SELECT pg_advisory_xact_lock(hashtextextended('throttlebeam migrate throttlebeam_idempotency', 0));

-- One row per key: in flight (done = false) until its lease ends, or
-- completed (done = true) with its result until its TTL ends. An expired
-- row is free: claims take it over, unless a transaction holds it locked (a
-- transactional run's claim lives as long as its transaction). A release
-- ends its lease now. The sweeper deletes a completed row once expired, and
-- a claim's a day later: until then a late completion of an earlier claim
-- of the key finds a later token, and is refused.
CREATE TABLE IF NOT EXISTS "throttlebeam_idempotency" (
    key         bytea       PRIMARY KEY,  -- the scoped key
    done        boolean     NOT NULL,     -- completed
    token       bytea       NOT NULL,     -- the owner's claim token (16 bytes)
    fence       bigint      NOT NULL,     -- the claim's fencing counter
    fingerprint bytea,                    -- SHA-256 of the request's fingerprint
    type_tag    text,                     -- the result's Rust type name
    value       bytea,                    -- the result in its versioned envelope
    expires_at  timestamptz NOT NULL      -- lease or TTL end, on the server's clock
);
CREATE INDEX IF NOT EXISTS "throttlebeam_idempotency_expires_at" ON "throttlebeam_idempotency" (expires_at);

-- Fencing counters: every claim takes the next one, so a claim is ordered
-- after every earlier claim of its key, however often the key was freed.
CREATE SEQUENCE IF NOT EXISTS "throttlebeam_idempotency_fence" AS bigint;

-- The write half of a claim, called only when the key has no live row:
-- wins it (returns its fence, and in left_ms where its row is: 2 * (block
-- * 65536 + offset of its ctid), plus 1 when it took an expired row over)
-- or returns what holds it. A row locked by a transaction is held, however
-- old its lease: a transactional run holds its claim's row locked while it
-- lives, and its key is free the moment its connection dies. A claim made
-- for a transactional run does not wait for its commit to be flushed
-- (p_durable = false): the run's own commit flushes it.
CREATE OR REPLACE FUNCTION "throttlebeam_idempotency_claim"(
    p_key bytea, p_token bytea, p_fingerprint bytea, p_lease_ms bigint, p_durable boolean,
    OUT done boolean, OUT fingerprint bytea, OUT type_tag text, OUT value bytea,
    OUT left_ms bigint, OUT fence bigint)
LANGUAGE plpgsql AS $claim$
#variable_conflict use_column
DECLARE
    held record;
    at tid;
BEGIN
    IF NOT p_durable THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    -- Never queue behind another claim's write for long: the caller answers busy.
    PERFORM set_config('lock_timeout', '200ms', true);
    INSERT INTO "throttlebeam_idempotency" AS r (key, done, token, fence, fingerprint, expires_at)
    VALUES (p_key, false, p_token, nextval('"throttlebeam_idempotency_fence"'), p_fingerprint,
            clock_timestamp() + p_lease_ms * interval '1 millisecond')
    ON CONFLICT (key) DO NOTHING
    RETURNING r.fence, r.ctid INTO fence, at;
    IF fence IS NOT NULL THEN
        left_ms := 2 * (((at::text::point)[0])::bigint * 65536 + ((at::text::point)[1])::bigint);
        RETURN;
    END IF;
    SELECT r.done, r.fingerprint, r.type_tag, r.value, r.expires_at INTO held
      FROM "throttlebeam_idempotency" AS r WHERE r.key = p_key FOR UPDATE SKIP LOCKED;
    IF FOUND THEN
        IF held.expires_at <= clock_timestamp() THEN
            UPDATE "throttlebeam_idempotency" AS r
               SET done = false, token = p_token, fence = nextval('"throttlebeam_idempotency_fence"'),
                   fingerprint = p_fingerprint, type_tag = NULL, value = NULL,
                   expires_at = clock_timestamp() + p_lease_ms * interval '1 millisecond'
             WHERE r.key = p_key
            RETURNING r.fence, r.ctid INTO fence, at;
            left_ms := 2 * (((at::text::point)[0])::bigint * 65536 + ((at::text::point)[1])::bigint) + 1;
            RETURN;
        END IF;
        done := held.done;
        fingerprint := held.fingerprint;
        type_tag := held.type_tag;
        value := held.value;
        left_ms := ceil(date_part('epoch', held.expires_at - clock_timestamp()) * 1000)::bigint;
        RETURN;
    END IF;
    -- Locked: a live transaction holds the key (or another claim or the
    -- sweeper has it this instant). In flight, for another second at most.
    SELECT r.done, r.fingerprint INTO held FROM "throttlebeam_idempotency" AS r WHERE r.key = p_key;
    IF FOUND THEN
        done := false;
        fingerprint := CASE WHEN held.done THEN p_fingerprint ELSE held.fingerprint END;
        left_ms := 1000;
    END IF;
END
$claim$;
COMMIT;

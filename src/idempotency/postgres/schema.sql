BEGIN;
SELECT pg_advisory_xact_lock(hashtextextended('throttlebeam migrate throttlebeam_idempotency', 0));

-- One row per key: in flight (done = false) until its lease ends, or
-- completed (done = true) with its result until its TTL ends. An expired
-- row is free: claims take it over, and the sweeper deletes it.
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

-- The write half of a claim, called only when the key is free or expired:
-- wins it (returns its fence) or, after losing a race, returns what the
-- winner left. A claim made for a transactional run does not wait for its
-- commit to be flushed (p_durable = false): the run's own commit flushes it.
CREATE OR REPLACE FUNCTION "throttlebeam_idempotency_claim"(
    p_key bytea, p_token bytea, p_fingerprint bytea, p_lease_ms bigint, p_durable boolean,
    OUT done boolean, OUT fingerprint bytea, OUT type_tag text, OUT value bytea,
    OUT left_ms bigint, OUT fence bigint)
LANGUAGE plpgsql AS $claim$
#variable_conflict use_column
BEGIN
    IF NOT p_durable THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    INSERT INTO "throttlebeam_idempotency" AS r (key, done, token, fence, fingerprint, expires_at)
    VALUES (p_key, false, p_token, nextval('"throttlebeam_idempotency_fence"'), p_fingerprint,
            clock_timestamp() + p_lease_ms * interval '1 millisecond')
    ON CONFLICT (key) DO UPDATE
        SET done = false, token = excluded.token, fence = excluded.fence,
            fingerprint = excluded.fingerprint, type_tag = NULL, value = NULL,
            expires_at = excluded.expires_at
        WHERE r.expires_at <= clock_timestamp()
    RETURNING r.fence INTO fence;
    IF fence IS NULL THEN
        SELECT r.done, r.fingerprint, r.type_tag, r.value,
               ceil(date_part('epoch', r.expires_at - clock_timestamp()) * 1000)::bigint
          INTO done, fingerprint, type_tag, value, left_ms
          FROM "throttlebeam_idempotency" AS r WHERE r.key = p_key;
    END IF;
END
$claim$;
COMMIT;

BEGIN;
SET LOCAL client_min_messages = warning;
DROP FUNCTION IF EXISTS "throttlebeam_idempotency_claim"(bytea, bytea, bytea, bigint, boolean);
DROP TABLE IF EXISTS "throttlebeam_idempotency";
DROP SEQUENCE IF EXISTS "throttlebeam_idempotency_fence";
COMMIT;

//! The SQL of one store table: its migration and the statement of each
//! operation, written once per table name.

use crate::store::StoreError;

/// The table a store uses when none is named.
pub(super) const DEFAULT_TABLE: &str = "throttlebeam_idempotency";

/// The longest table name (without its schema): the names derived from it
/// (`_expires_at`, `_fence`, `_claim`) must fit PostgreSQL's 63 bytes.
const MAX_TABLE: usize = 48;

/// The longest schema name PostgreSQL keeps whole.
const MAX_SCHEMA: usize = 63;

/// How long the sweeper keeps the row of a claim that ended without a result (released, or
/// lapsed): the fence against a late completion of an earlier claim of its key, as long as
/// the Redis store keeps a key's last claim with the default TTL.
pub(super) const FENCE_RETENTION: &str = "24 hours";

/// The longest channel name PostgreSQL accepts.
const MAX_CHANNEL: usize = 63;

/// A validated table name, optionally schema-qualified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct TableName {
    schema: Option<String>,
    table: String,
}

impl TableName {
    /// `name` (`table` or `schema.table`) if each part is lowercase ASCII
    /// letters, digits and underscores, starts with a letter or underscore
    /// and fits PostgreSQL's limits.
    pub(super) fn parse(name: &str) -> Result<Self, StoreError> {
        let invalid = |reason: &str| {
            StoreError::Config(format!("invalid postgres table name {name:?}: {reason}"))
        };
        let (schema, table) = match name.split_once('.') {
            Some((schema, table)) => (Some(schema), table),
            None => (None, name),
        };
        for (part, what, max) in [
            (schema, "schema", MAX_SCHEMA),
            (Some(table), "table", MAX_TABLE),
        ] {
            let Some(part) = part else { continue };
            if part.is_empty() {
                return Err(invalid(&format!("the {what} name is empty")));
            }
            if part.len() > max {
                return Err(invalid(&format!(
                    "the {what} name is longer than {max} bytes"
                )));
            }
            let mut chars = part.chars();
            let first_ok = chars
                .next()
                .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
            if !first_ok || !chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            {
                return Err(invalid(&format!(
                    "the {what} name must be lowercase letters, digits and underscores, \
                     starting with a letter or underscore"
                )));
            }
        }
        Ok(Self {
            schema: schema.map(str::to_owned),
            table: table.to_owned(),
        })
    }

    /// `"schema".` or nothing.
    fn qualifier(&self) -> String {
        self.schema
            .as_ref()
            .map_or_else(String::new, |s| format!("\"{s}\"."))
    }

    /// The quoted name of the table, or of an object named after it.
    fn object(&self, suffix: &str) -> String {
        format!("{}\"{}{suffix}\"", self.qualifier(), self.table)
    }

    /// The name as given: `schema.table` or `table`.
    pub(super) fn plain(&self) -> String {
        match &self.schema {
            Some(schema) => format!("{schema}.{}", self.table),
            None => self.table.clone(),
        }
    }
}

/// Every statement of one table.
#[derive(Debug)]
pub(super) struct Sql {
    pub(super) table: TableName,
    /// The `LISTEN`/`NOTIFY` channel of the table's changes.
    pub(super) channel: String,
    pub(super) migrate: String,
    /// What undoes `migrate`.
    pub(super) undo: String,
    pub(super) claim: String,
    /// A transactional run's first statement: locks its claim's row (if it is still this
    /// token's), sets the transaction's timeouts, and names the transaction. Inside the run's
    /// transaction the row is reached by its `ctid` alone (a TID scan), never through an
    /// index: at SERIALIZABLE an index scan takes a predicate lock on the index page, which
    /// the completion of a run of another key on that page would conflict with.
    pub(super) lock: String,
    /// A transactional run's completion, in its transaction: stores the result if the row is
    /// still this token's and the transaction is the one that locked it.
    pub(super) complete_locked: String,
    pub(super) complete: String,
    pub(super) release: String,
    pub(super) renew: String,
    pub(super) sweep: String,
}

impl Sql {
    pub(super) fn new(table: TableName) -> Self {
        let t = table.object("");
        let claim_fn = table.object("_claim");
        let plain = table.plain();
        let channel = if plain.len() + 3 <= MAX_CHANNEL {
            format!("tb:{plain}")
        } else {
            format!("tb:{:016x}", fnv1a(plain.as_bytes()))
        };
        Self {
            migrate: migration(&table),
            undo: undo(&table),
            lock: format!(
                "SELECT txid_current(), \
                        set_config('statement_timeout', $3, true), \
                        set_config('idle_in_transaction_session_timeout', $3, true) \
                   FROM {t} WHERE ctid = $4::text::tid AND key = $1 AND token = $2 AND NOT done \
                    FOR UPDATE"
            ),
            complete_locked: format!(
                "WITH stored AS ( \
                     UPDATE {t} AS r \
                        SET done = true, fingerprint = $3, type_tag = $4, value = $5, \
                            expires_at = clock_timestamp() + $6::bigint * interval '1 millisecond' \
                      WHERE r.ctid = $9::text::tid AND r.key = $1 AND r.token = $2 AND NOT r.done \
                        AND txid_current() = $8 \
                     RETURNING pg_notify($7, encode(sha256(r.key), 'hex')) AS notified \
                 ) \
                 SELECT count(*) FROM stored"
            ),
            claim: format!(
                "(SELECT done, fingerprint, type_tag, value, \
                        ceil(date_part('epoch', expires_at - clock_timestamp()) * 1000)::bigint AS left_ms, \
                        CASE WHEN NOT done AND token = $2 THEN fence END AS fence \
                   FROM {t} WHERE key = $1 AND expires_at > clock_timestamp()) \
                 UNION ALL \
                 (SELECT * FROM {claim_fn}($1, $2, $3, $4, $5)) \
                 LIMIT 1"
            ),
            complete: format!(
                "WITH stored AS ( \
                     INSERT INTO {t} AS r (key, done, token, fence, fingerprint, type_tag, value, expires_at) \
                     VALUES ($1, true, $2, 0, $3, $4, $5, clock_timestamp() + $6::bigint * interval '1 millisecond') \
                     ON CONFLICT (key) DO UPDATE \
                         SET done = true, fingerprint = excluded.fingerprint, type_tag = excluded.type_tag, \
                             value = excluded.value, expires_at = excluded.expires_at \
                         WHERE NOT r.done AND r.token = excluded.token \
                     RETURNING pg_notify($7, encode(sha256(r.key), 'hex')) AS notified \
                 ) \
                 SELECT EXISTS (SELECT 1 FROM stored) \
                     OR EXISTS (SELECT 1 FROM {t} WHERE key = $1 AND done AND token = $2 AND value = $5 \
                                                   AND expires_at > clock_timestamp())"
            ),
            // The row stays, free (its lease ended now), with the releasing claim's token: a
            // late completion of an earlier claim of the key (an owner paused past its lease,
            // whose key was taken over and released since) finds another token and is
            // refused, as it would be had the key not been released. A claim takes it over;
            // the sweeper deletes it a day later (see `sweep`).
            release: format!(
                "WITH gone AS ( \
                     UPDATE {t} SET expires_at = clock_timestamp() \
                      WHERE key = $1 AND token = $2 AND NOT done \
                     RETURNING pg_notify($3, encode(sha256(key), 'hex')) AS notified \
                 ) \
                 SELECT count(*) FROM gone"
            ),
            renew: format!(
                "UPDATE {t} SET expires_at = clock_timestamp() + $3::bigint * interval '1 millisecond' \
                  WHERE key = $1 AND token = $2 AND NOT done"
            ),
            // A completed row goes once its TTL ends. A claim's row (released, or lapsed with
            // its owner gone or paused) is kept for `FENCE_RETENTION` after its lease ended:
            // while it is there, a late completion of an earlier claim finds a later claim's
            // token and is refused, and the late completion of the last claim finds its own.
            sweep: format!(
                "DELETE FROM {t} WHERE key = ANY (ARRAY( \
                     SELECT key FROM {t} WHERE expires_at <= clock_timestamp() \
                        AND (done OR expires_at <= clock_timestamp() - interval '{FENCE_RETENTION}') \
                      ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED))"
            ),
            channel,
            table,
        }
    }
}

/// The migration of `table`: idempotent, quiet (no "already exists" notices), serialized by an
/// advisory lock so that instances starting together do not race on the catalog.
fn migration(table: &TableName) -> String {
    let t = table.object("");
    let index = format!("\"{}_expires_at\"", table.table);
    let sequence = table.object("_fence");
    let claim_fn = table.object("_claim");
    let plain = table.plain();
    format!(
        r#"BEGIN;
SET LOCAL client_min_messages = warning;
SELECT pg_advisory_xact_lock(hashtextextended('throttlebeam migrate {plain}', 0));

-- One row per key: in flight (done = false) until its lease ends, or
-- completed (done = true) with its result until its TTL ends. An expired
-- row is free: claims take it over, unless a transaction holds it locked (a
-- transactional run's claim lives as long as its transaction). A release
-- ends its lease now. The sweeper deletes a completed row once expired, and
-- a claim's a day later: until then a late completion of an earlier claim
-- of the key finds a later token, and is refused.
CREATE TABLE IF NOT EXISTS {t} (
    key         bytea       PRIMARY KEY,  -- the scoped key
    done        boolean     NOT NULL,     -- completed
    token       bytea       NOT NULL,     -- the owner's claim token (16 bytes)
    fence       bigint      NOT NULL,     -- the claim's fencing counter
    fingerprint bytea,                    -- SHA-256 of the request's fingerprint
    type_tag    text,                     -- the result's Rust type name
    value       bytea,                    -- the result in its versioned envelope
    expires_at  timestamptz NOT NULL      -- lease or TTL end, on the server's clock
);
CREATE INDEX IF NOT EXISTS {index} ON {t} (expires_at);

-- Fencing counters: every claim takes the next one, so a claim is ordered
-- after every earlier claim of its key, however often the key was freed.
CREATE SEQUENCE IF NOT EXISTS {sequence} AS bigint;

-- The write half of a claim, called only when the key has no live row:
-- wins it (returns its fence, and in left_ms where its row is: 2 * (block
-- * 65536 + offset of its ctid), plus 1 when it took an expired row over)
-- or returns what holds it. A row locked by a transaction is held, however
-- old its lease: a transactional run holds its claim's row locked while it
-- lives, and its key is free the moment its connection dies. A claim made
-- for a transactional run does not wait for its commit to be flushed
-- (p_durable = false): the run's own commit flushes it.
CREATE OR REPLACE FUNCTION {claim_fn}(
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
    INSERT INTO {t} AS r (key, done, token, fence, fingerprint, expires_at)
    VALUES (p_key, false, p_token, nextval('{sequence}'), p_fingerprint,
            clock_timestamp() + p_lease_ms * interval '1 millisecond')
    ON CONFLICT (key) DO NOTHING
    RETURNING r.fence, r.ctid INTO fence, at;
    IF fence IS NOT NULL THEN
        left_ms := 2 * (((at::text::point)[0])::bigint * 65536 + ((at::text::point)[1])::bigint);
        RETURN;
    END IF;
    SELECT r.done, r.fingerprint, r.type_tag, r.value, r.expires_at INTO held
      FROM {t} AS r WHERE r.key = p_key FOR UPDATE SKIP LOCKED;
    IF FOUND THEN
        IF held.expires_at <= clock_timestamp() THEN
            UPDATE {t} AS r
               SET done = false, token = p_token, fence = nextval('{sequence}'),
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
    SELECT r.done, r.fingerprint INTO held FROM {t} AS r WHERE r.key = p_key;
    IF FOUND THEN
        done := false;
        fingerprint := CASE WHEN held.done THEN p_fingerprint ELSE held.fingerprint END;
        left_ms := 1000;
    END IF;
END
$claim$;
COMMIT;
"#
    )
}

/// What undoes [`migration`]: drops the table (every key and result in it), its sequence
/// and its claim function.
fn undo(table: &TableName) -> String {
    let t = table.object("");
    let sequence = table.object("_fence");
    let claim_fn = table.object("_claim");
    format!(
        "BEGIN;\n\
         SET LOCAL client_min_messages = warning;\n\
         DROP FUNCTION IF EXISTS {claim_fn}(bytea, bytea, bytea, bigint, boolean);\n\
         DROP TABLE IF EXISTS {t};\n\
         DROP SEQUENCE IF EXISTS {sequence};\n\
         COMMIT;\n"
    )
}

/// FNV-1a, 64 bits: a stable short name for a long channel.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_migration_is_the_one_run() {
        let sql = Sql::new(TableName::parse(DEFAULT_TABLE).unwrap());
        assert_eq!(sql.migrate, include_str!("schema.sql"));
        assert_eq!(sql.undo, include_str!("undo.sql"));
        assert_eq!(sql.channel, "tb:throttlebeam_idempotency");
    }

    #[test]
    fn table_names_are_checked_and_quoted() {
        let qualified = TableName::parse("billing.idem_keys").unwrap();
        assert_eq!(qualified.plain(), "billing.idem_keys");
        let sql = Sql::new(qualified);
        assert!(sql.claim.contains("FROM \"billing\".\"idem_keys\" WHERE"));
        assert!(sql.claim.contains("\"billing\".\"idem_keys_claim\"($1"));
        assert!(
            sql.migrate
                .contains("nextval('\"billing\".\"idem_keys_fence\"')")
        );
        for (bad, reason) in [
            ("", "the table name is empty"),
            ("a.", "the table name is empty"),
            (".a", "the schema name is empty"),
            ("Keys", "lowercase letters"),
            ("1keys", "lowercase letters"),
            ("a.b.c", "lowercase letters"),
            ("keys; drop table x", "lowercase letters"),
            ("k\"eys", "lowercase letters"),
        ] {
            let e = TableName::parse(bad).unwrap_err().to_string();
            assert!(
                e.contains(reason) && e.contains("invalid postgres table name"),
                "{bad:?}: {e}"
            );
        }
        let long = "t".repeat(MAX_TABLE + 1);
        let e = TableName::parse(&long).unwrap_err().to_string();
        assert!(e.contains("longer than 48 bytes"), "{e}");
        assert!(TableName::parse(&"t".repeat(MAX_TABLE)).is_ok());
    }

    #[test]
    fn a_long_qualified_name_gets_a_short_stable_channel() {
        let name = format!("{}.{}", "s".repeat(40), "t".repeat(40));
        let sql = Sql::new(TableName::parse(&name).unwrap());
        assert!(sql.channel.len() <= MAX_CHANNEL, "{}", sql.channel);
        assert_eq!(
            sql.channel,
            Sql::new(TableName::parse(&name).unwrap()).channel
        );
        assert_ne!(
            sql.channel,
            Sql::new(TableName::parse("a.b").unwrap()).channel
        );
    }
}

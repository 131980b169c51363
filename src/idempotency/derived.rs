//! [`IdempotencyKey`]: a key in its scope, and the keys derived from it for the effects an
//! operation has outside the database (a card network's own idempotency key).

use std::sync::Arc;

use sha2::{Digest, Sha256};

use super::IdempotencyOptions;
use super::full_key::with_full_key;

/// An idempotency key in its scope, as a run holds it: the source of stable keys for the
/// steps of the operation that leave the process.
///
/// A payment usually charges a card through a processor that takes an idempotency key of its
/// own. [`IdempotencyKey::derive`] gives each step a key that is the same on every retry of
/// the same request (same key, same scope) and different for every step and every other
/// request: if a run charged the card and then failed before it committed (a crash, a
/// rollback), the retry runs again and sends the same derived key, so the processor answers
/// with the first charge instead of charging twice.
///
/// # Examples
///
/// ```
/// use throttlebeam::IdempotencyOptions;
/// use throttlebeam::idempotency::IdempotencyKey;
///
/// let options = IdempotencyOptions::new().with_scope("tenant-7");
/// let key = IdempotencyKey::new("order-1001", &options);
/// let charge = key.derive("charge");
/// assert_eq!(charge, IdempotencyKey::new("order-1001", &options).derive("charge"));
/// assert_ne!(charge, key.derive("refund"));
/// assert_ne!(charge, IdempotencyKey::new("order-1001", &IdempotencyOptions::new()).derive("charge"));
/// assert!(charge.starts_with("tb1-") && charge.len() == 4 + 32);
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey {
    /// The scoped form of the key (see `full_key`).
    scoped: Arc<str>,
    /// How long the caller's key is: `scoped` ends with it.
    key_len: usize,
}

impl std::fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyKey")
            .field("key", &crate::key::shown(self.key()))
            .finish_non_exhaustive()
    }
}

impl IdempotencyKey {
    /// `key` in the scope of `options` (none: unscoped), as a run with those options holds
    /// it.
    #[must_use]
    pub fn new(key: &str, options: &IdempotencyOptions) -> Self {
        Self::from_scoped(
            with_full_key(options.scope(), key, |full| Arc::from(full)),
            key.len(),
        )
    }

    /// A key from its scoped form and the length of the caller's key at its end.
    pub(crate) fn from_scoped(scoped: Arc<str>, key_len: usize) -> Self {
        Self { scoped, key_len }
    }

    /// The scoped form, as stores keep the key.
    #[cfg_attr(not(all(feature = "http", feature = "postgres")), allow(dead_code))]
    pub(crate) fn scoped(&self) -> &str {
        &self.scoped
    }

    /// The caller's key, without its scope.
    #[must_use]
    pub fn key(&self) -> &str {
        self.scoped
            .get(self.scoped.len().saturating_sub(self.key_len)..)
            .unwrap_or_default()
    }

    /// A key for `step` of the operation (`"charge"`, `"refund"`, `"email"`): `tb1-` and 32
    /// hex digits (128 bits of SHA-256 over the scoped key and the step), the same for every
    /// retry of the same key in the same scope, and different for every other step, key or
    /// scope. Short and plain enough for any processor's idempotency key (Stripe takes up to
    /// 255 characters).
    #[must_use]
    pub fn derive(&self, step: &str) -> String {
        let mut hasher = Sha256::new();
        hasher.update(b"throttlebeam derived key v1\0");
        hasher.update((self.scoped.len() as u64).to_be_bytes());
        hasher.update(self.scoped.as_bytes());
        hasher.update((step.len() as u64).to_be_bytes());
        hasher.update(step.as_bytes());
        let digest = hasher.finalize();
        let mut out = String::with_capacity(36);
        out.push_str("tb1-");
        for byte in &digest[..16] {
            out.push(char::from(b"0123456789abcdef"[usize::from(byte >> 4)]));
            out.push(char::from(b"0123456789abcdef"[usize::from(byte & 15)]));
        }
        out
    }
}

//! The full key of an idempotency lookup: `key` in its scope, in one
//! form that no other (scope, key) pair shares.

use std::cell::RefCell;

/// The longest full key built on the stack; longer ones take the buffer of
/// [`with_full_key`].
const STACK: usize = 96;

/// Runs `f` on the bytes of `(scope, key)`'s full form (the form of
/// [`with_full_key`]), built in a stack buffer when it fits: the replay fast
/// path then touches no thread-local and borrows no cell.
#[inline]
pub(super) fn with_full_key_bytes<R>(
    scope: Option<&str>,
    key: &str,
    f: impl FnOnce(&[u8]) -> R,
) -> R {
    let mut buffer = [0_u8; STACK];
    let len = match scope {
        None if key.len() < STACK => {
            buffer[0] = b'-';
            buffer[1..=key.len()].copy_from_slice(key.as_bytes());
            key.len() + 1
        }
        Some(scope) => {
            let mut digits = itoa::Buffer::new();
            let digits = digits.format(scope.len()).as_bytes();
            let len = digits.len() + 1 + scope.len() + key.len();
            if len > STACK {
                return with_full_key(Some(scope), key, |full| f(full.as_bytes()));
            }
            let (head, rest) = buffer.split_at_mut(digits.len());
            head.copy_from_slice(digits);
            rest[0] = b':';
            rest[1..=scope.len()].copy_from_slice(scope.as_bytes());
            rest[1 + scope.len()..1 + scope.len() + key.len()].copy_from_slice(key.as_bytes());
            len
        }
        None => return with_full_key(None, key, |full| f(full.as_bytes())),
    };
    f(&buffer[..len])
}

/// Runs `f` on the scoped form of `key`, built in a reused per-thread
/// buffer so the replay path allocates nothing.
///
/// The form is `-key` without a scope and `<len>:<scope>key` with one:
/// the first byte tells them apart and the length says where the scope
/// ends, so no two (scope, key) pairs share a form.
pub(crate) fn with_full_key<R>(scope: Option<&str>, key: &str, f: impl FnOnce(&str) -> R) -> R {
    thread_local! {
        static BUFFER: RefCell<String> = const { RefCell::new(String::new()) };
    }
    fn encode(buffer: &mut String, scope: Option<&str>, key: &str) {
        buffer.clear();
        match scope {
            None => buffer.push('-'),
            Some(scope) => {
                // `itoa`, not `write!`: this runs on every lookup.
                buffer.push_str(itoa::Buffer::new().format(scope.len()));
                buffer.push(':');
                buffer.push_str(scope);
            }
        }
        buffer.push_str(key);
    }
    // `with` only fails inside another thread-local's destructor, which never calls us.
    BUFFER.with(|buffer| match buffer.try_borrow_mut() {
        Ok(mut buffer) => {
            encode(&mut buffer, scope, key);
            f(&buffer)
        }
        Err(_) => {
            let mut own = String::new();
            encode(&mut own, scope, key);
            f(&own)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::{with_full_key, with_full_key_bytes};

    #[test]
    fn the_stack_form_is_the_buffer_form() {
        let long = "k".repeat(200);
        let scopes = [None, Some("t"), Some("tenant-42"), Some(long.as_str())];
        let keys = ["", "k", "order:1234", long.as_str()];
        for scope in scopes {
            for key in keys {
                let stack = with_full_key_bytes(scope, key, <[u8]>::to_vec);
                let buffer = with_full_key(scope, key, |full| full.as_bytes().to_vec());
                assert_eq!(stack, buffer, "scope {scope:?}, key of {} bytes", key.len());
            }
        }
    }

    #[test]
    fn full_keys_never_collide_across_scopes() {
        let forms: Vec<String> = [
            (None, "1:ab"),
            (Some("a"), "b"),
            (Some("ab"), ""),
            (Some("1:a"), "b"),
            (None, "-x"),
        ]
        .iter()
        .map(|(scope, key)| with_full_key(*scope, key, str::to_owned))
        .collect();
        let mut unique = forms.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), forms.len(), "{forms:?}");
        assert_eq!(forms[1], "1:ab");
        assert_eq!(forms[0], "-1:ab");
        // The scope's length in decimal, every digit of it.
        for len in [9, 10, 14, 99, 100, 255, 1000] {
            let scope = "s".repeat(len);
            let full = with_full_key(Some(&scope), "k", str::to_owned);
            assert_eq!(full, format!("{len}:{scope}k"));
        }
    }
}

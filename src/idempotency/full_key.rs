//! The full key of a replay's lookup, built on the stack.

/// The longest full key built on the stack; longer ones take the buffer of
/// [`super::claim::with_full_key`].
const STACK: usize = 96;

/// Runs `f` on the bytes of `(scope, key)`'s full form (the form of
/// [`super::claim::with_full_key`]), built in a stack buffer when it fits: the replay fast
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
                return super::claim::with_full_key(Some(scope), key, |full| f(full.as_bytes()));
            }
            let (head, rest) = buffer.split_at_mut(digits.len());
            head.copy_from_slice(digits);
            rest[0] = b':';
            rest[1..=scope.len()].copy_from_slice(scope.as_bytes());
            rest[1 + scope.len()..1 + scope.len() + key.len()].copy_from_slice(key.as_bytes());
            len
        }
        None => return super::claim::with_full_key(None, key, |full| f(full.as_bytes())),
    };
    f(&buffer[..len])
}

#[cfg(test)]
mod tests {
    use super::with_full_key_bytes;
    use crate::idempotency::claim::with_full_key;

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
}

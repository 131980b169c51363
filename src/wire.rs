//! The versioned envelope of every value one instance hands another
//! through a shared store (idempotency results, debounce outcomes).
//!
//! An envelope is three header bytes, `t`, `b` and the format version, then
//! the payload in the format that version names. Version 1 is bincode 2
//! (`config::standard()`, serde). A value is always decoded with a size
//! limit ([`MAX_DECODED`]) and must be read to its last byte, so a stored
//! value this build cannot read is a typed [`WireError`], never a panic, an
//! unbounded allocation or a value misread: a build with another codec
//! writes another version, and the builds tell each other's values apart
//! by it.

use std::sync::Arc;

use bincode::config::{Configuration, Limit, LittleEndian, Varint};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::BoxError;

/// The format version this build writes (and the only one it reads).
pub(crate) const VERSION: u8 = 1;

/// What opens every envelope, so a value written by something else (or
/// before envelopes) is told apart from a version this build cannot read.
const MAGIC: [u8; 2] = *b"tb";

/// Header bytes before the payload.
const HEADER: usize = MAGIC.len() + 1;

/// The most an envelope's payload may hold, and the most memory decoding
/// one may claim: 256 MiB, what a runtime keeps of results by default
/// ([`DEFAULT_MAX_IDEMPOTENCY_BYTES`](crate::idempotency::DEFAULT_MAX_IDEMPOTENCY_BYTES)).
pub(crate) const MAX_DECODED: usize = 256 << 20;

/// bincode settings of version 1. Part of the format: changing them means
/// a new version.
const CODEC: Configuration<LittleEndian, Varint, Limit<MAX_DECODED>> =
    bincode::config::standard().with_limit::<MAX_DECODED>();

/// Why a value could not be sealed in an envelope or read from one.
///
/// The source of [`Error::StoreUnavailable`](crate::Error::StoreUnavailable)
/// when a shared store holds a result this build cannot read (written by a
/// build with another format version, say): the call fails closed, neither
/// running the operation again nor misreading the value.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The value is in a format version this build does not read.
    #[error("stored value has format version {found}; this build reads version {supported}")]
    UnknownVersion {
        /// The version the value was written in.
        found: u8,
        /// The version this build reads and writes.
        supported: u8,
    },
    /// The value is not in an envelope at all (written by something else,
    /// or truncated before its header ended).
    #[error("stored value is not in a throttlebeam envelope")]
    NotEnveloped,
    /// The value is larger than an envelope may hold.
    #[error("value of {len} bytes is over the limit of {limit} bytes")]
    TooLarge {
        /// The value's size.
        len: usize,
        /// The limit (256 MiB).
        limit: usize,
    },
    /// The payload could not be encoded, or does not decode exactly (it is
    /// truncated, has bytes left over, or claims more memory than the limit).
    #[error("value could not be {what}")]
    Codec {
        /// `"encoded"` or `"decoded"`.
        what: &'static str,
        /// The codec's error.
        #[source]
        source: BoxError,
    },
}

impl WireError {
    fn codec(what: &'static str, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::Codec {
            what,
            source: Arc::new(source),
        }
    }
}

/// Why bytes were left over after a payload.
#[derive(Debug, thiserror::Error)]
#[error("{0} bytes left over after the value")]
struct LeftOver(usize);

/// `value` in an envelope of the current version.
pub(crate) fn seal<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, WireError> {
    let mut out = Vec::with_capacity(HEADER + 16);
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    bincode::serde::encode_into_std_write(value, &mut out, CODEC)
        .map_err(|e| WireError::codec("encoded", e))?;
    check_len(out.len() - HEADER, MAX_DECODED)?;
    Ok(out)
}

/// The value in `bytes`, an envelope [`seal`] made.
pub(crate) fn open<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, WireError> {
    decode(payload(bytes, MAX_DECODED)?)
}

/// A value of the current version's payload format, without a header (a
/// value nested in an enveloped one), decoded with the size limit and to its
/// last byte.
pub(crate) fn decode<T: DeserializeOwned>(payload: &[u8]) -> Result<T, WireError> {
    match bincode::serde::decode_from_slice::<T, _>(payload, CODEC) {
        Ok((value, read)) if read == payload.len() => Ok(value),
        Ok((_, read)) => Err(WireError::codec("decoded", LeftOver(payload.len() - read))),
        Err(e) => Err(WireError::codec("decoded", e)),
    }
}

/// `value` in the current version's payload format, without a header (to
/// nest in an enveloped value).
#[cfg_attr(
    not(feature = "redis"),
    allow(dead_code, reason = "debounce across instances")
)]
pub(crate) fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, WireError> {
    let bytes =
        bincode::serde::encode_to_vec(value, CODEC).map_err(|e| WireError::codec("encoded", e))?;
    check_len(bytes.len(), MAX_DECODED)?;
    Ok(bytes)
}

/// The payload of the envelope `bytes`, checked for its header, version
/// and size (at most `limit` bytes).
fn payload(bytes: &[u8], limit: usize) -> Result<&[u8], WireError> {
    let Some((header, payload)) = bytes.split_first_chunk::<HEADER>() else {
        return Err(WireError::NotEnveloped);
    };
    if header[..MAGIC.len()] != MAGIC {
        return Err(WireError::NotEnveloped);
    }
    let found = header[MAGIC.len()];
    if found != VERSION {
        return Err(WireError::UnknownVersion {
            found,
            supported: VERSION,
        });
    }
    check_len(payload.len(), limit)?;
    Ok(payload)
}

fn check_len(len: usize, limit: usize) -> Result<(), WireError> {
    if len > limit {
        return Err(WireError::TooLarge { len, limit });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Charge {
        id: u64,
        note: String,
        parts: Vec<u32>,
    }

    fn charge() -> Charge {
        Charge {
            id: 7,
            note: "paid".to_owned(),
            parts: vec![1, 2, 3],
        }
    }

    #[test]
    fn a_value_round_trips_in_a_versioned_envelope() {
        let sealed = seal(&charge()).unwrap();
        assert_eq!(&sealed[..3], b"tb\x01");
        assert_eq!(open::<Charge>(&sealed).unwrap(), charge());
        // The payload is plain bincode 2 `standard()`, as the format says.
        let plain = bincode::serde::encode_to_vec(charge(), bincode::config::standard()).unwrap();
        assert_eq!(&sealed[3..], &plain[..]);
    }

    #[test]
    fn another_version_is_refused_not_misread() {
        let mut sealed = seal(&charge()).unwrap();
        sealed[2] = 2;
        let e = open::<Charge>(&sealed).unwrap_err();
        assert!(
            matches!(
                e,
                WireError::UnknownVersion {
                    found: 2,
                    supported: 1
                }
            ),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            "stored value has format version 2; this build reads version 1"
        );
    }

    #[test]
    fn bytes_without_an_envelope_are_refused() {
        let plain = bincode::serde::encode_to_vec(charge(), bincode::config::standard()).unwrap();
        for bytes in [&plain[..], b"", b"t", b"tb"] {
            assert!(
                matches!(open::<Charge>(bytes), Err(WireError::NotEnveloped)),
                "{bytes:?}"
            );
        }
    }

    #[test]
    fn truncated_or_padded_payloads_are_typed_errors() {
        let sealed = seal(&charge()).unwrap();
        for cut in HEADER..sealed.len() {
            let e = open::<Charge>(&sealed[..cut]).unwrap_err();
            assert!(
                matches!(
                    e,
                    WireError::Codec {
                        what: "decoded",
                        ..
                    }
                ),
                "{cut}: {e:?}"
            );
        }
        let mut padded = sealed.clone();
        padded.push(0);
        let e = open::<Charge>(&padded).unwrap_err();
        assert_eq!(e.to_string(), "value could not be decoded");
        let source = std::error::Error::source(&e).unwrap().to_string();
        assert_eq!(source, "1 bytes left over after the value");
    }

    #[test]
    fn an_oversize_payload_is_refused_before_decoding() {
        let sealed = seal(&vec![0u8; 100]).unwrap();
        let e = payload(&sealed, 64).unwrap_err();
        assert!(
            matches!(
                e,
                WireError::TooLarge {
                    len: 101,
                    limit: 64
                }
            ),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            "value of 101 bytes is over the limit of 64 bytes"
        );
        assert!(payload(&sealed, 101).is_ok());
    }

    #[test]
    fn a_length_prefix_claiming_more_than_the_limit_is_refused_without_allocating() {
        // A string that claims 1 TiB in a few bytes: bincode allocates a
        // string's bytes before reading them, so without the limit decoding
        // it would abort the process.
        let mut forged = b"tb\x01".to_vec();
        forged.push(253); // varint: a u64 follows
        forged.extend_from_slice(&(1u64 << 40).to_le_bytes());
        let e = open::<String>(&forged).unwrap_err();
        assert!(
            matches!(
                e,
                WireError::Codec {
                    what: "decoded",
                    ..
                }
            ),
            "{e:?}"
        );
        let source = std::error::Error::source(&e).unwrap().to_string();
        assert!(source.contains("LimitExceeded"), "{source}");
    }
}

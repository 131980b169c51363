//! The versioned envelope of every value one instance hands another
//! through a shared store (idempotency results, debounce outcomes).
//!
//! An envelope is three header bytes, `t`, `b` and the format version, then
//! the payload in the format that version names:
//!
//! | version | payload | |
//! | --- | --- | --- |
//! | 1 | bincode 2, `config::standard()` (serde) | read, no longer written |
//! | 2 | MessagePack (rmp-serde): structs as maps with their field names, enums by variant name, the human-readable form of types that have two, `u128`/`i128` as 16 big-endian bytes | written |
//! | 255 | reserved: no value, the UTF-8 text of why a result could not be stored | written |
//!
//! Version 2 is self-describing, so every serde form round-trips, those that
//! need `deserialize_any` too (`serde_json::Value`, untagged and internally
//! tagged enums, `flatten`, `skip_serializing_if`), which bincode cannot
//! read back. Human-readable forms because serde buffers an untagged,
//! internally tagged or flattened value in a form that always asks for
//! them: an `IpAddr` written in its compact form inside one would not read
//! back.
//!
//! A value is always decoded with a size limit ([`MAX_DECODED`]), a nesting
//! limit ([`MAX_DEPTH`]) and must be read to its last byte, so a stored value
//! this build cannot read is a typed [`WireError`], never a panic, an
//! unbounded allocation or a value misread: a build with another codec
//! writes another version, and the builds tell each other's values apart
//! by it.

use std::sync::Arc;

use bincode::config::{Configuration, Limit, LittleEndian, Varint};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::BoxError;

/// The format version this build writes (and the newest it reads).
pub(crate) const VERSION: u8 = 2;

/// Not a format version: the envelope of a result that could not be stored,
/// whose payload is why, in UTF-8 ([`seal_unstorable`]).
const UNSTORABLE: u8 = 255;

/// What opens every envelope, so a value written by something else (or
/// before envelopes) is told apart from a version this build cannot read.
const MAGIC: [u8; 2] = *b"tb";

/// Header bytes before the payload.
const HEADER: usize = MAGIC.len() + 1;

/// The most an envelope's payload may hold, and the most memory decoding
/// one may claim: 256 MiB, what a runtime keeps of results by default
/// ([`DEFAULT_MAX_IDEMPOTENCY_BYTES`](crate::idempotency::DEFAULT_MAX_IDEMPOTENCY_BYTES)).
pub(crate) const MAX_DECODED: usize = 256 << 20;

/// The deepest nesting of arrays and maps a version 2 payload may have:
/// decoding recurses once per level, so hostile bytes must not choose the
/// depth. A struct is one level, an enum variant with data two. At this
/// depth a `serde_json::Value` takes under 1 MiB of stack to decode in a
/// debug build (about 3.5 KiB a level; rmp-serde's default of 1024 levels
/// overflows a 2 MiB thread there), well within a tokio worker's 2 MiB.
pub(crate) const MAX_DEPTH: usize = 256;

/// The longest reason an unstorable result keeps, in bytes.
const MAX_CAUSE: usize = 4096;

/// bincode settings of version 1. Part of the format: changing them means
/// a new version.
const CODEC: Configuration<LittleEndian, Varint, Limit<MAX_DECODED>> =
    bincode::config::standard().with_limit::<MAX_DECODED>();

/// Why a value could not be sealed in an envelope or read from one.
///
/// The source of [`Error::StoreUnavailable`](crate::Error::StoreUnavailable)
/// when a shared store holds a result this build cannot read (written by a
/// build with another format version, say): the call fails closed, neither
/// running the operation again nor misreading the value. The source of
/// [`Error::Unstorable`](crate::Error::Unstorable) for a key whose function
/// ran but whose result could not be stored.
///
/// The format: three header bytes, `t`, `b` and the version, then the
/// payload. Version 2, the one written, is MessagePack with structs as maps
/// (self-describing: every serde form reads back); version 1, bincode 2
/// `standard()`, written by earlier releases, is still read.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The value is in a format version this build does not read.
    #[error("stored value has format version {found}; this build reads versions 1 to {supported}")]
    UnknownVersion {
        /// The version the value was written in.
        found: u8,
        /// The newest version this build reads, the one it writes.
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
    /// truncated, has bytes left over, nests deeper than 256 levels, claims
    /// more memory than the limit, or is not of the type asked for).
    #[error("value could not be {what}")]
    Codec {
        /// `"encoded"` or `"decoded"`.
        what: &'static str,
        /// The codec's error.
        #[source]
        source: BoxError,
    },
    /// A value encodes, but its encoding does not decode as its own type, so
    /// a shared store could keep it but never hand it back: a field
    /// skipped when serialized that has no default, a `serialize_with`
    /// without the matching `deserialize_with`, a nesting deeper than 256
    /// levels.
    #[error("a value of type {type_name} does not decode from its own encoding")]
    RoundTrip {
        /// The value's type (its Rust type name).
        type_name: &'static str,
        /// Why its encoding does not decode.
        #[source]
        source: BoxError,
    },
    /// The store holds no value but the record of one that could not be
    /// stored (on this instance or another): why, as text.
    #[error("{cause}")]
    Unstorable {
        /// Why the value could not be stored, with its causes.
        cause: String,
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
enum LeftOver {
    #[error("{0} bytes left over after the value")]
    Counted(usize),
    #[error("bytes left over after the value")]
    Some,
}

/// The payload format an envelope's version names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    /// Version 1: bincode 2 `standard()`, not self-describing (a value of
    /// another type of the same shape reads back silently). Read only.
    Bincode,
    /// Version 2: MessagePack, structs as maps, human-readable forms.
    MessagePack,
}

impl Format {
    fn of(version: u8) -> Option<Self> {
        match version {
            1 => Some(Self::Bincode),
            2 => Some(Self::MessagePack),
            _ => None,
        }
    }

    /// Whether a value of this format names its fields and variants, so
    /// that decoding it as another type fails unless that type reads it.
    pub(crate) fn is_self_describing(self) -> bool {
        matches!(self, Self::MessagePack)
    }

    /// A value of this format's payload, without a header (a value nested
    /// in an enveloped one), decoded with the size and depth limits and to
    /// its last byte.
    pub(crate) fn decode<T: DeserializeOwned>(self, payload: &[u8]) -> Result<T, WireError> {
        match self {
            Self::Bincode => match bincode::serde::decode_from_slice::<T, _>(payload, CODEC) {
                Ok((value, read)) if read == payload.len() => Ok(value),
                Ok((_, read)) => Err(WireError::codec(
                    "decoded",
                    LeftOver::Counted(payload.len() - read),
                )),
                Err(e) => Err(WireError::codec("decoded", e)),
            },
            Self::MessagePack => decode_msgpack(payload),
        }
    }
}

/// A version 2 payload as a `T`. Decoding borrows strings and bytes from
/// `payload`, so a length prefix larger than what is left fails without
/// allocating.
fn decode_msgpack<T: DeserializeOwned>(payload: &[u8]) -> Result<T, WireError> {
    let mut de = rmp_serde::Deserializer::from_read_ref(payload).with_human_readable();
    de.set_max_depth(MAX_DEPTH);
    let value = T::deserialize(&mut de).map_err(|e| WireError::codec("decoded", e))?;
    // The decoder does not tell where it stopped: the payload ended with the
    // value if not even one more marker can be read.
    match serde::de::IgnoredAny::deserialize(&mut de) {
        Err(rmp_serde::decode::Error::InvalidMarkerRead(e))
            if e.kind() == std::io::ErrorKind::UnexpectedEof =>
        {
            Ok(value)
        }
        _ => Err(WireError::codec("decoded", LeftOver::Some)),
    }
}

/// `value` as a version 2 payload, written to `out`.
fn encode_msgpack<T, W>(value: &T, out: W) -> Result<(), WireError>
where
    T: Serialize + ?Sized,
    W: std::io::Write,
{
    let mut ser = rmp_serde::Serializer::new(out)
        .with_struct_map()
        .with_human_readable();
    value
        .serialize(&mut ser)
        .map_err(|e| WireError::codec("encoded", e))
}

/// An envelope's payload, in the format its version names.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Payload<'a> {
    pub(crate) format: Format,
    pub(crate) bytes: &'a [u8],
}

impl Payload<'_> {
    /// The payload as a `T` (see [`Format::decode`]).
    pub(crate) fn decode<T: DeserializeOwned>(&self) -> Result<T, WireError> {
        self.format.decode(self.bytes)
    }
}

/// `value` in an envelope of the current version.
pub(crate) fn seal<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, WireError> {
    let mut out = Vec::with_capacity(HEADER + 16);
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    encode_msgpack(value, &mut out)?;
    check_len(out.len() - HEADER, MAX_DECODED)?;
    Ok(out)
}

/// [`seal`], then the envelope decoded back as a `T`: a value whose
/// encoding its own type cannot read is [`WireError::RoundTrip`], before
/// anything is stored.
pub(crate) fn seal_checked<T>(value: &T) -> Result<Vec<u8>, WireError>
where
    T: Serialize + DeserializeOwned,
{
    let sealed = seal(value)?;
    match decode_msgpack::<T>(&sealed[HEADER..]) {
        Ok(_) => Ok(sealed),
        Err(WireError::Codec { source, .. }) => Err(WireError::RoundTrip {
            type_name: std::any::type_name::<T>(),
            source,
        }),
        Err(other) => Err(other),
    }
}

/// The envelope of a result that could not be stored: no value, only
/// `cause` (cut to 4 KiB), which [`unseal`] hands back as
/// [`WireError::Unstorable`].
#[allow(
    dead_code,
    reason = "for the completion path, which records unstorable runs"
)]
pub(crate) fn seal_unstorable(cause: &str) -> Vec<u8> {
    let mut end = cause.len().min(MAX_CAUSE);
    while !cause.is_char_boundary(end) {
        end -= 1;
    }
    let mut out = Vec::with_capacity(HEADER + end);
    out.extend_from_slice(&MAGIC);
    out.push(UNSTORABLE);
    out.extend_from_slice(&cause.as_bytes()[..end]);
    out
}

/// The value in `bytes`, an envelope [`seal`] made (or one of version 1).
#[cfg(test)]
pub(crate) fn open<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, WireError> {
    unseal(bytes)?.decode()
}

/// The payload of the envelope `bytes`, checked for its header, version and
/// size. An envelope of an unstorable result is [`WireError::Unstorable`].
pub(crate) fn unseal(bytes: &[u8]) -> Result<Payload<'_>, WireError> {
    payload(bytes, MAX_DECODED)
}

/// `value` in the current version's payload format, without a header (to
/// nest in an enveloped value).
#[cfg_attr(
    not(feature = "redis"),
    allow(dead_code, reason = "debounce across instances")
)]
pub(crate) fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, WireError> {
    let mut bytes = Vec::new();
    encode_msgpack(value, &mut bytes)?;
    check_len(bytes.len(), MAX_DECODED)?;
    Ok(bytes)
}

/// The size of `value`'s payload in the current version, counted without
/// keeping the bytes.
pub(crate) fn encoded_len<T: Serialize + ?Sized>(value: &T) -> Result<usize, WireError> {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    encode_msgpack(value, &mut count)?;
    Ok(count.0)
}

/// The payload of the envelope `bytes`, checked for its header, version
/// and size (at most `limit` bytes).
fn payload(bytes: &[u8], limit: usize) -> Result<Payload<'_>, WireError> {
    let Some((header, payload)) = bytes.split_first_chunk::<HEADER>() else {
        return Err(WireError::NotEnveloped);
    };
    if header[..MAGIC.len()] != MAGIC {
        return Err(WireError::NotEnveloped);
    }
    let version = header[MAGIC.len()];
    if version == UNSTORABLE {
        let cause = &payload[..payload.len().min(MAX_CAUSE)];
        return Err(WireError::Unstorable {
            cause: String::from_utf8_lossy(cause).into_owned(),
        });
    }
    let Some(format) = Format::of(version) else {
        return Err(WireError::UnknownVersion {
            found: version,
            supported: VERSION,
        });
    };
    check_len(payload.len(), limit)?;
    Ok(Payload {
        format,
        bytes: payload,
    })
}

fn check_len(len: usize, limit: usize) -> Result<(), WireError> {
    if len > limit {
        return Err(WireError::TooLarge { len, limit });
    }
    Ok(())
}

#[cfg(test)]
mod tests;

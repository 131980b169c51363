//! Outcomes as they travel between instances: the wire form of a value or
//! an error, and its decoding for one result type.

use std::any::TypeId;
use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::debounce::Value;
use crate::error::Error;
use crate::key::shown;
use crate::wire::{self, Format};

/// An outcome as it travels between instances: in the versioned envelope
/// ([`crate::wire`]), the value nested in the payload's format (that of the
/// envelope's version: an instance of an earlier release nests bincode).
#[derive(serde::Serialize, serde::Deserialize)]
enum Wire {
    Value {
        tag: String,
        #[serde(with = "as_bytes")]
        bytes: Vec<u8>,
    },
    Unencodable(String),
    Failed(String),
    Panicked(String),
    Discarded(String),
}

/// `wire` sealed; a value too large for an envelope travels as the
/// error it is.
fn seal(wire: &Wire) -> Vec<u8> {
    wire::seal(wire)
        .or_else(|e| wire::seal(&Wire::Unencodable(e.to_string())))
        .unwrap_or_default()
}

/// The wire form of a value of `T`, tagged with its type.
pub(in crate::debounce) fn encode_value<T: Serialize>(value: &T) -> Vec<u8> {
    let wire = match wire::encode(value) {
        Ok(bytes) => Wire::Value {
            tag: std::any::type_name::<T>().to_owned(),
            bytes,
        },
        Err(e) => Wire::Unencodable(describe(&e)),
    };
    seal(&wire)
}

/// An error with its causes, as one line of text.
fn describe(error: &dyn std::error::Error) -> String {
    let mut message = error.to_string();
    let mut cause = error.source();
    while let Some(c) = cause {
        message.push_str(": ");
        message.push_str(&c.to_string());
        cause = c.source();
    }
    message
}

pub(super) fn encode_error(error: &Error) -> Vec<u8> {
    let wire = match error {
        Error::Failed { source, .. } => Wire::Failed(describe(&**source)),
        Error::Panicked { message, .. } => Wire::Panicked(message.clone()),
        Error::Discarded { reason, .. } => Wire::Discarded((*reason).to_owned()),
        other => Wire::Failed(other.to_string()),
    };
    seal(&wire)
}

/// Nested bytes as one byte string (MessagePack `bin`, not an array of
/// numbers); bincode writes both forms alike, so version 1 reads as before.
mod as_bytes {
    use serde::{Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(bytes)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        struct Bytes;
        impl<'de> serde::de::Visitor<'de> for Bytes {
            type Value = Vec<u8>;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("bytes")
            }

            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
                Ok(v.to_vec())
            }

            fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
                Ok(v)
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Vec<u8>, A::Error> {
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
                while let Some(b) = seq.next_element()? {
                    out.push(b);
                }
                Ok(out)
            }
        }
        d.deserialize_byte_buf(Bytes)
    }
}

/// Decodes the values of one result type.
#[derive(Clone, Copy)]
pub(in crate::debounce) struct Codec {
    pub(super) type_id: TypeId,
    tag: &'static str,
    decode: fn(Format, &[u8]) -> Option<Value>,
}

impl Codec {
    pub(in crate::debounce) fn of<T: DeserializeOwned + Send + Sync + 'static>() -> Self {
        fn decode<T: DeserializeOwned + Send + Sync + 'static>(
            format: Format,
            bytes: &[u8],
        ) -> Option<Value> {
            format.decode::<T>(bytes).ok().map(|v| Arc::new(v) as Value)
        }
        Self {
            type_id: TypeId::of::<T>(),
            tag: std::any::type_name::<T>(),
            decode: decode::<T>,
        }
    }

    /// The outcome in `bytes` for `key`'s callers: the value, or the error
    /// the run ended with. Bytes that do not decode are a
    /// [`Error::TypeMismatch`]; an envelope this build cannot read (another
    /// format version, say) is a [`Error::StoreUnavailable`] whose source is
    /// the [`WireError`](crate::store::WireError): never misread.
    ///
    /// A value tagged with another type name is decoded all the same when
    /// its format names its fields (version 2: the type moved or was
    /// renamed between builds), and refused when it does not (version 1).
    pub(super) fn outcome(&self, key: &str, bytes: &[u8]) -> Result<Value, Error> {
        let mismatch = || Error::TypeMismatch { key: shown(key) };
        let unsealed =
            wire::unseal(bytes).and_then(|payload| Ok((payload.format, payload.decode::<Wire>()?)));
        let (format, wire) = match unsealed {
            Ok(opened) => opened,
            Err(wire::WireError::Codec { .. }) => return Err(mismatch()),
            Err(unreadable) => {
                tracing::warn!(
                    key = %shown(key),
                    error = %unreadable,
                    "debounce: an outcome from another instance is unreadable by this build"
                );
                return Err(Error::StoreUnavailable {
                    key: shown(key),
                    source: Arc::new(unreadable),
                });
            }
        };
        match wire {
            Wire::Value { tag, bytes } if tag == self.tag || format.is_self_describing() => {
                (self.decode)(format, &bytes).ok_or_else(mismatch)
            }
            Wire::Value { .. } => Err(mismatch()),
            Wire::Unencodable(message) => Err(Error::failed(
                key,
                Remote(format!("the result could not be encoded: {message}")),
            )),
            Wire::Failed(message) => Err(Error::failed(key, Remote(message))),
            Wire::Panicked(message) => Err(Error::Panicked {
                key: shown(key),
                message,
            }),
            Wire::Discarded(reason) => Err(Error::Discarded {
                key: shown(key),
                reason: discard_reason(&reason),
            }),
        }
    }
}

/// The error of a function that failed on another instance, as text.
#[derive(Debug)]
struct Remote(String);

impl std::fmt::Display for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Remote {}

pub(super) const LOST: &str = "the instance owning its run was lost";

pub(super) fn discard_reason(reason: &str) -> &'static str {
    [
        "cancelled",
        "dropped at shutdown",
        "its process was lost",
        "the runtime restarted",
        LOST,
    ]
    .into_iter()
    .find(|r| *r == reason)
    .unwrap_or("discarded on another instance")
}

//! What a caller was told, in the checker's terms, and the one function that maps the
//! library's results onto it.
//!
//! When the library's outcomes change (it is about to gain a "ran, not recorded" outcome
//! carrying the value), [`classify_once`] is the one place to update.

use serde::{Deserialize, Serialize};
use throttlebeam::{Error, IdempotencyOutcome};

/// What a call was told, as the checker judges it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "is", rename_all = "snake_case")]
pub(crate) enum Outcome {
    /// Ran here and recorded: replays follow with this value.
    Fresh { value: String },
    /// Another run's recorded value.
    Replay { value: String },
    /// Ran here and failed or panicked: released by design.
    RanFailed { why: String },
    /// Ran here, not recorded (today `Error::LeaseLost`; the value when the library hands it).
    RanNotRecorded {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        value: Option<String>,
        why: String,
    },
    /// Nothing ran here (`StoreUnavailable`, `Timeout`, `InFlight`, `ShutDown`, …).
    NothingRan { why: String },
    /// A leading throttle ran this call's function.
    Executed { value: String },
    /// A leading throttle turned this call away.
    Throttled,
    /// A rate limit admitted this call (in the window ending at `reset_at_ms`).
    Allowed { reset_at_ms: u64 },
    /// A rate limit refused this call (or failed closed).
    Denied { why: String },
    /// A debounced call's covering run gave this value.
    Debounced { value: String },
}

impl Outcome {
    /// Short form for reports.
    pub(crate) fn short(&self) -> String {
        match self {
            Self::Fresh { value } => format!("Fresh({value})"),
            Self::Replay { value } => format!("Replay({value})"),
            Self::RanFailed { why } => format!("RanFailed[{why}]"),
            Self::RanNotRecorded { value, why } => {
                format!("RanNotRecorded({})[{why}]", value.as_deref().unwrap_or("-"))
            }
            Self::NothingRan { why } => format!("NothingRan[{why}]"),
            Self::Executed { value } => format!("Executed({value})"),
            Self::Throttled => "Throttled".to_owned(),
            Self::Allowed { reset_at_ms } => format!("Allowed(reset {reset_at_ms})"),
            Self::Denied { why } => format!("Denied[{why}]"),
            Self::Debounced { value } => format!("Debounced({value})"),
        }
    }
}

/// The name of an error's variant, with its first source for context.
pub(crate) fn error_name(e: &Error) -> String {
    let name = match e {
        Error::InvalidKey { .. } => "InvalidKey",
        Error::InvalidArgument { .. } => "InvalidArgument",
        Error::InvalidSetting { .. } => "InvalidSetting",
        Error::InvalidConfig { .. } => "InvalidConfig",
        Error::TooManyKeys { .. } => "TooManyKeys",
        Error::ShutDown { .. } => "ShutDown",
        Error::RuntimeDown { .. } => "RuntimeDown",
        Error::Discarded { .. } => "Discarded",
        Error::Failed { .. } => "Failed",
        Error::Panicked { .. } => "Panicked",
        Error::Timeout { .. } => "Timeout",
        Error::FingerprintMismatch { .. } => "FingerprintMismatch",
        Error::TypeMismatch { .. } => "TypeMismatch",
        Error::LeaseLost { .. } => "LeaseLost",
        Error::InFlight { .. } => "InFlight",
        Error::NoTokio => "NoTokio",
        Error::Start(_) => "Start",
        Error::StoreUnavailable { .. } => "StoreUnavailable",
        _ => "Other",
    };
    match std::error::Error::source(e) {
        Some(source) => {
            let mut s = source.to_string();
            if s.len() > 60 {
                let mut cut = 60;
                while !s.is_char_boundary(cut) {
                    cut -= 1;
                }
                s.truncate(cut);
                s.push('…');
            }
            format!("{name}: {s}")
        }
        None => name.to_owned(),
    }
}

/// THE mapping of an at-most-once call's result (runtime, transactional run) to what the
/// caller was told. `tag` names a value as the checker knows it (the op's unique string).
pub(crate) fn classify_once<T>(
    result: Result<IdempotencyOutcome<T>, Error>,
    tag: impl Fn(&T) -> String,
) -> Outcome {
    match result {
        Ok(IdempotencyOutcome::Fresh(v)) => Outcome::Fresh { value: tag(&v) },
        Ok(IdempotencyOutcome::Replay(v)) => Outcome::Replay { value: tag(&v) },
        // Ran here, succeeded, not the key's recorded result: the value comes back.
        Ok(IdempotencyOutcome::Unrecorded(v, why)) => Outcome::RanNotRecorded {
            value: Some(tag(&v)),
            why: format!("Unrecorded({why:?})"),
        },
        Err(e) => {
            let why = error_name(&e);
            match e {
                Error::Failed { .. } | Error::Panicked { .. } => Outcome::RanFailed { why },
                // A transactional run taken over before its commit (rolled back), or a
                // reservation's result not recorded: ran here, not stored.
                Error::LeaseLost { .. } | Error::NotRecorded { .. } => {
                    Outcome::RanNotRecorded { value: None, why }
                }
                // StoreUnavailable, Timeout, InFlight, ShutDown, RuntimeDown, TooManyKeys,
                // FingerprintMismatch, TypeMismatch, Discarded and anything newer: the
                // library says nothing ran here.
                _ => Outcome::NothingRan { why },
            }
        }
    }
}

/// The same mapping for a response of the HTTP `IdempotencyLayer`: `replayed` is its
/// `idempotent-replayed` header, `body` the handler's value.
pub(crate) fn classify_http(status: u16, replayed: bool, body: String) -> Outcome {
    match status {
        200..=299 if replayed => Outcome::Replay { value: body },
        200..=299 => Outcome::Fresh { value: body },
        // The handler fails by design with 500 (not stored: released).
        500 => Outcome::RanFailed {
            why: format!("HTTP 500 {body}"),
        },
        // 409 (in flight, wait timed out), 422 (fingerprint), 503 (store), 400…: the layer
        // says the handler did not run.
        _ => Outcome::NothingRan {
            why: format!("HTTP {status}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_library_results_map_to_what_ran() {
        let tag = |v: &String| v.clone();
        assert_eq!(
            classify_once(Ok(IdempotencyOutcome::Fresh("a".to_owned())), tag),
            Outcome::Fresh {
                value: "a".to_owned()
            }
        );
        let lost = classify_once::<String>(
            Err(Error::LeaseLost {
                key: "k".to_owned(),
            }),
            tag,
        );
        assert!(matches!(lost, Outcome::RanNotRecorded { .. }));
        let timeout = classify_once::<String>(
            Err(Error::Timeout {
                key: "k".to_owned(),
                after: std::time::Duration::from_secs(1),
            }),
            tag,
        );
        assert!(matches!(timeout, Outcome::NothingRan { .. }));
        assert!(matches!(
            classify_http(500, false, "x".to_owned()),
            Outcome::RanFailed { .. }
        ));
    }
}

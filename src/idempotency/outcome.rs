//! What an idempotent call tells its caller: whether the function ran here, and whether its
//! result is the key's recorded one.

use crate::error::NotRecorded;

/// Whether an idempotent call ran its function, replayed a stored result, or ran its
/// function without its result being recorded.
///
/// | outcome | the function ran in this call | its result is the key's, stored for replays |
/// |---|---|---|
/// | [`Fresh`](Self::Fresh) | yes | yes |
/// | [`Replay`](Self::Replay) | no (another call's run) | yes |
/// | [`Unrecorded`](Self::Unrecorded) | yes, and succeeded | no: see [`NotRecorded`] |
///
/// An [`Error`](crate::Error) says nothing ran in this call, except
/// [`Error::Failed`](crate::Error::Failed) and [`Error::Panicked`](crate::Error::Panicked)
/// (the function ran and failed: the key is released, a retry runs it again).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[must_use]
pub enum IdempotencyOutcome<T> {
    /// This call ran the function; its value is the key's result, stored for replays.
    Fresh(T),
    /// Another call already ran it (or was running it); this is its value.
    Replay(T),
    /// This call ran the function, which succeeded, but its value is not the key's recorded
    /// result, for the reason given. The effect of the function happened: a caller that
    /// must not repeat it should act on this value (and may have to reconcile later, see
    /// [`NotRecorded`]), not retry.
    Unrecorded(T, NotRecorded),
}

impl<T> IdempotencyOutcome<T> {
    /// The value, fresh, replayed or unrecorded.
    pub fn into_inner(self) -> T {
        match self {
            Self::Fresh(value) | Self::Replay(value) | Self::Unrecorded(value, _) => value,
        }
    }

    /// The value, by reference.
    #[must_use]
    pub fn value(&self) -> &T {
        match self {
            Self::Fresh(value) | Self::Replay(value) | Self::Unrecorded(value, _) => value,
        }
    }

    /// Whether this call ran the function and its value is the key's recorded result.
    #[must_use]
    pub fn is_fresh(&self) -> bool {
        matches!(self, Self::Fresh(_))
    }

    /// Whether the value is another call's stored result.
    #[must_use]
    pub fn is_replay(&self) -> bool {
        matches!(self, Self::Replay(_))
    }

    /// Whether this call ran the function (fresh or unrecorded).
    #[must_use]
    pub fn ran_here(&self) -> bool {
        !self.is_replay()
    }

    /// Why this call's value is not the key's recorded result, if it is not.
    #[must_use]
    pub fn not_recorded(&self) -> Option<NotRecorded> {
        match self {
            Self::Unrecorded(_, why) => Some(*why),
            Self::Fresh(_) | Self::Replay(_) => None,
        }
    }
}

//! OTP-style machinery for short-lived per-key processes.

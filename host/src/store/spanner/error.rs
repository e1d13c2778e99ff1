//! The one place Spanner's errors are classified for the protocol
//! ([`StoreError`]): by gRPC code, then by transport failure.

use super::*;

pub(super) fn classify(e: google_cloud_spanner::Error) -> StoreError {
    classify_ref(&e)
}

pub(super) fn classify_ref(e: &google_cloud_spanner::Error) -> StoreError {
    use google_cloud_gax::error::rpc::Code;
    // onceq's own error, carried out of a transaction's closure as it was.
    if let Some(own) = std::error::Error::source(e).and_then(|s| s.downcast_ref::<StoreError>()) {
        return own.clone();
    }
    let text = e.to_string();
    if let Some(status) = e.status() {
        return match status.code {
            Code::Aborted => StoreError::Aborted(text),
            Code::OutOfRange => StoreError::AssertionFailed(text),
            Code::AlreadyExists | Code::NotFound | Code::FailedPrecondition | Code::InvalidArgument => StoreError::WriteRefused(text),
            Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown | Code::Internal => {
                StoreError::UnknownOutcome(text)
            }
            Code::ResourceExhausted => StoreError::Unavailable(text),
            _ => StoreError::Permanent(text),
        };
    }
    if e.is_timeout() || e.is_transport() || e.is_io() {
        StoreError::UnknownOutcome(text)
    } else {
        StoreError::Permanent(text)
    }
}

/// Map `OUT_OF_RANGE` from an `ASSERT_ROWS_MODIFIED 1` on a lease to
/// `LeaseLost`.
pub(super) fn lease_error(e: StoreError, lease: &Lease) -> StoreError {
    match e {
        StoreError::AssertionFailed(_) => StoreError::LeaseLost {
            message_id: lease.message_id.clone(),
        },
        other => other,
    }
}

/// onceq's own error inside a transaction's closure, as the client's error
/// (the transaction rolls back), to be classified as what it was
/// ([`classify`] finds it again).
pub(super) fn carried(e: StoreError) -> google_cloud_spanner::Error {
    google_cloud_spanner::Error::ser(e)
}

/// One of onceq's own invariants did not hold inside a transaction.
pub(super) fn invariant(text: String) -> google_cloud_spanner::Error {
    carried(StoreError::Invariant(text))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
    use super::*;
    use google_cloud_gax::error::rpc::{Code, Status};

    fn status(code: Code) -> google_cloud_spanner::Error {
        google_cloud_spanner::Error::service(Status::default().set_code(code).set_message("from the server"))
    }

    /// Every gRPC code the protocol must tell apart: re-run now, re-run
    /// after a pause, resolve an unknown outcome by the ack, a refused
    /// write (the message's), or the store's own trouble.
    #[test]
    fn each_code_is_classified_for_the_protocol() {
        let cases = [
            (Code::Aborted, "aborted"),
            (Code::OutOfRange, "assertion_failed"),
            (Code::AlreadyExists, "write_refused"),
            (Code::NotFound, "write_refused"),
            (Code::FailedPrecondition, "write_refused"),
            (Code::InvalidArgument, "write_refused"),
            (Code::Unavailable, "unknown_outcome"),
            (Code::DeadlineExceeded, "unknown_outcome"),
            (Code::Cancelled, "unknown_outcome"),
            (Code::Unknown, "unknown_outcome"),
            (Code::Internal, "unknown_outcome"),
            (Code::ResourceExhausted, "unavailable"),
            (Code::PermissionDenied, "permanent"),
            (Code::Unauthenticated, "permanent"),
            (Code::Unimplemented, "permanent"),
        ];
        for (code, class) in cases {
            let e = classify(status(code));
            assert_eq!(e.class(), class, "{code:?}: {e}");
            assert!(e.to_string().contains("from the server"), "{code:?}: the server's words kept: {e}");
        }
    }

    #[test]
    fn a_timeout_or_a_cut_connection_is_an_unknown_outcome() {
        let timeout = google_cloud_spanner::Error::timeout("deadline passed");
        assert!(classify(timeout).is_unknown_outcome());
        let io = google_cloud_spanner::Error::io("connection reset by peer");
        assert!(classify(io).is_unknown_outcome());
    }

    /// onceq's own failures inside a transaction come out as themselves,
    /// not as a write the database refused.
    #[test]
    fn onceqs_own_errors_keep_their_class() {
        let e = classify(invariant("a message failed after it was decided".into()));
        assert_eq!(e.class(), "invariant", "{e}");
        assert!(e
            .to_string()
            .contains("onceq invariant broken: a message failed after it was decided"));
        let e = classify(carried(StoreError::Permanent("column x holds a STRING".into())));
        assert_eq!(e, StoreError::Permanent("column x holds a STRING".into()));
        assert!(
            !crate::protocol::HandlerFailure::from_store(e).is_own(),
            "the store's trouble, not the message's"
        );
    }

    #[test]
    fn a_failed_assertion_on_a_lease_is_a_lost_lease() {
        let lease = Lease {
            queue: "q".into(),
            message_id: "m".into(),
            shard: 0,
            token: "t".into(),
        };
        let e = lease_error(classify(status(Code::OutOfRange)), &lease);
        assert_eq!(e, StoreError::LeaseLost { message_id: "m".into() });
        let other = lease_error(StoreError::Aborted("x".into()), &lease);
        assert_eq!(other.class(), "aborted");
    }
}

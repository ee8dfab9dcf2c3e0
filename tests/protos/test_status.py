"""The one table between millpond's errors and gRPC status codes (protos/status.py)."""

import errno

import grpc
import pytest

import millpond.errors as errors
from millpond.errors import (
    ClosedError,
    DeadlineExceededError,
    InvalidDataError,
    MillpondError,
    RateLimiterTimeoutError,
    ResourceExhaustedError,
    ShardUnavailableError,
)
from millpond.protos.status import STATUS, error_from_status, status_of

ERROR_CLASSES = [
    getattr(errors, name) for name in errors.__all__ if getattr(errors, name) is not MillpondError
]


def test_every_error_class_has_a_status() -> None:
    assert set(ERROR_CLASSES) == set(STATUS)


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_an_error_crosses_the_wire_as_its_own_class(cls) -> None:
    code, details, name = status_of(cls("the shard's words"))
    assert code == STATUS[cls]
    back = error_from_status(code, details, name)
    expected = ShardUnavailableError if cls is ClosedError else cls
    assert type(back) is expected
    assert str(back) == "the shard's words"


def test_a_rate_limiter_timeout_is_told_by_its_name_not_its_words() -> None:
    code, details, name = status_of(RateLimiterTimeoutError("waited 2 s for 8 more steps"))
    assert type(error_from_status(code, details, name)) is RateLimiterTimeoutError
    # gRPC's own deadline (no name) and a plain deadline stay DeadlineExceededError.
    plain = error_from_status(grpc.StatusCode.DEADLINE_EXCEEDED, "rate limiter timed out")
    assert type(plain) is DeadlineExceededError


def test_a_name_that_does_not_fit_its_code_is_ignored() -> None:
    err = error_from_status(grpc.StatusCode.INVALID_ARGUMENT, "x", "RateLimiterTimeoutError")
    assert type(err) is InvalidDataError
    err = error_from_status(grpc.StatusCode.INVALID_ARGUMENT, "x", "SystemExit")
    assert type(err) is InvalidDataError


def test_a_full_disk_is_resource_exhausted_and_the_rest_internal() -> None:
    code, details, name = status_of(OSError(errno.ENOSPC, "No space left on device"))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "disk full" in details
    assert type(error_from_status(code, details, name)) is ResourceExhaustedError
    code, details, name = status_of(KeyError("boom"))
    assert code == grpc.StatusCode.INTERNAL and name is None and "KeyError" in details
    assert type(error_from_status(code, details, name)) is MillpondError

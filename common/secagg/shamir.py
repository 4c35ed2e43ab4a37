"""t-of-n Shamir secret sharing of 32-byte secrets over the prime field of 2^521 - 1.

Hand-written because ``cryptography`` has no secret sharing; it is the textbook scheme: a
random polynomial of degree t - 1 over the field whose constant term is the secret, one point
of it per holder, Lagrange interpolation at 0 to recover it. The coefficients come from the
operating system's generator (``secrets``).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence

#: A Mersenne prime larger than any 32-byte secret.
PRIME = 2**521 - 1
SHARE_BYTES = 66  # ceil(521 / 8)
SECRET_BYTES = 32


def split(secret: bytes, holders: Sequence[int], threshold: int) -> dict[int, bytes]:
    """Shares of ``secret`` for holders at the distinct non-zero points ``holders``: any
    ``threshold`` of them recover it, fewer learn nothing about it."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"a secret is {SECRET_BYTES} bytes")
    if not 1 <= threshold <= len(holders):
        raise ValueError(f"threshold {threshold} must be 1-{len(holders)} (the holders)")
    if len(set(holders)) != len(holders) or any(not 0 < x < PRIME for x in holders):
        raise ValueError("holders must be distinct points of the field, not 0")
    coefficients = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME)
                                                      for _ in range(threshold - 1)]
    shares = {}
    for x in holders:
        y = 0
        for a in reversed(coefficients):  # Horner
            y = (y * x + a) % PRIME
        shares[x] = y.to_bytes(SHARE_BYTES, "big")
    return shares


def combine(shares: Mapping[int, bytes]) -> bytes:
    """The secret from at least ``threshold`` shares (point -> share). With fewer, or with a
    share that is not one of the polynomial's, the result is a wrong secret, not an error:
    callers check what the secret opens."""
    points = [(int(x), int.from_bytes(y, "big")) for x, y in shares.items()]
    secret = 0
    for i, (xi, yi) in enumerate(points):
        num, den = 1, 1
        for j, (xj, _) in enumerate(points):
            if i != j:
                num = (num * -xj) % PRIME
                den = (den * (xi - xj)) % PRIME
        secret = (secret + yi * num * pow(den, -1, PRIME)) % PRIME
    if secret >= 2 ** (8 * SECRET_BYTES):
        raise ValueError("the shares do not open a 32-byte secret: too few, or not genuine")
    return secret.to_bytes(SECRET_BYTES, "big")

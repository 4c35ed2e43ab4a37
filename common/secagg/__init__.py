"""Secure aggregation (SecAgg+, Bell et al. 2020): the pieces both sides share.

* :mod:`common.secagg.ring` turns an update into elements of the ring Z/2^32 and a sum of
  them back into floats (the clipping range and the bound on the error are stated there);
* :mod:`common.secagg.crypto` holds the primitives, all from the ``cryptography`` package:
  X25519 key agreement, HKDF-SHA256, ChaCha20 as the mask generator, AES-GCM for the shares;
* :mod:`common.secagg.shamir` is t-of-n secret sharing over a prime field;
* :mod:`common.secagg.graph` is who is paired with whom (SecAgg+'s k-regular graph).

The protocol's stages (keys, shares, masked input, unmasking) live in ``worker/secagg.py``
and ``master/secagg.py``; docs/PROTOCOL.md writes them down.
"""

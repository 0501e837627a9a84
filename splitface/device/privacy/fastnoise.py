"""A fast noise source a server cannot predict: ChaCha20's keystream under a key from the OS CSPRNG.

Why not `torch.randn` on a seeded `torch.Generator`: Mersenne Twister is not a cryptographic
generator (its state follows from its outputs), one generator is one serial stream, and a seed is
easy to fix by mistake. ChaCha20 is counter-based (block i is a function of the key and i alone, so
blocks can be made on any core in any order) and its output is unpredictable without the key.
Keys are 32 bytes: `fresh_key()` reads them from `os.urandom`, one per release; a caller that must
replay a release with the same noise (a re-sent batch) derives the key from a secret that itself
came from the OS CSPRNG. An integer seed is refused, so a fixed seed cannot reach production by
accident; tests pass explicit key bytes.

Two outputs: exact uniform integers (`uniform_below`, for the discrete Gaussian in `discrete.py`)
and float32 Gaussians (`gaussian`, Box-Muller). The float Gaussians are fast, not exact: like every
floating-point sampler their low bits are not those of a Gaussian, which can leak the noiseless
value (Mironov 2012 for the Laplace; the same holds here). `docs/device.md` says which option gives
which guarantee.
"""
from __future__ import annotations

import math
import os

import numpy as np
import torch

KEY_BYTES = 32


def fresh_key() -> bytes:
    """A new 256-bit key from the OS CSPRNG: one per release, unless the release must be replayable."""
    return os.urandom(KEY_BYTES)


class NoiseStream:
    """The ChaCha20 keystream of `key` (from block `counter` on), read as little-endian words."""

    def __init__(self, key: bytes, counter: int = 0) -> None:
        if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
            raise ValueError(f"the key must be {KEY_BYTES} bytes from the OS CSPRNG (fresh_key()), not "
                             f"{type(key).__name__}: a seed a person chose is predictable")
        if not 0 <= counter < 2**32:
            raise ValueError(f"counter must be in [0, 2^32), got {counter}")
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

        nonce = counter.to_bytes(4, "little") + bytes(12)  # ChaCha20's 32-bit block counter, then the nonce
        self._cipher = Cipher(algorithms.ChaCha20(bytes(key), nonce), mode=None).encryptor()

    def random_bytes(self, n: int) -> bytes:
        return self._cipher.update(bytes(n))  # encrypting zeros gives the keystream itself

    def words32(self, n: int) -> np.ndarray:
        return np.frombuffer(self.random_bytes(4 * n), dtype="<u4").astype(np.uint64)

    def words64(self, n: int) -> np.ndarray:
        return np.frombuffer(self.random_bytes(8 * n), dtype="<u8")

    def bits(self, n: int) -> np.ndarray:
        """n fair coins, as bool."""
        return np.unpackbits(np.frombuffer(self.random_bytes((n + 7) // 8), dtype=np.uint8), count=n).astype(bool)

    def uniform_below(self, bound: int, n: int) -> np.ndarray:
        """n independent integers uniform on [0, bound), exactly (int64); 1 <= bound <= 2^62.

        Bounds below 2^32 take Lemire's multiply-shift on 32-bit words: m = u * bound, result m >> 32,
        redrawn when m mod 2^32 < 2^32 mod bound (those words would make some results likelier). Larger
        bounds take 64-bit words kept when u >= 2^64 mod bound, then u mod bound. Either way the kept
        words cover each result equally often, so the result is exactly uniform.
        """
        if not 1 <= bound <= 2**62:
            raise ValueError(f"bound must be in [1, 2^62], got {bound}")
        small = bound < 2**32
        out = np.empty(n, dtype=np.int64)
        todo: np.ndarray | None = None  # None: every lane
        while todo is None or todo.size:
            m = n if todo is None else todo.size
            if small:
                product = np.frombuffer(self.random_bytes(4 * m), dtype="<u4").astype(np.uint64) * np.uint64(bound)
                ok = (product & np.uint64(0xFFFFFFFF)) >= np.uint64(2**32 % bound)
                values = (product >> np.uint64(32)).astype(np.int64)
            else:
                u = self.words64(m)
                ok = u >= np.uint64(2**64 % bound)
                values = (u % np.uint64(bound)).astype(np.int64)
            if todo is None:
                out[:] = values
                todo = np.flatnonzero(~ok)
            else:
                out[todo[ok]] = values[ok]
                todo = todo[~ok]
        return out


def chacha_words(key: bytes, first: int, blocks: int, rounds: int) -> np.ndarray:
    """Keystream blocks first .. first + blocks - 1 of ChaCha with `rounds` rounds under `key`, as (blocks, 16)
    uint32 words, in RFC 8439's layout with the nonce zero (the block counter's low and high halves in words 12
    and 13): at 20 rounds `NoiseStream`'s bytes, at 8 the native runner's float noise (gaussian_noise.h).

    Plain numpy, vectorised over blocks: a reference for the tests and benchmarks, independent of the runner's
    C++; `cryptography` offers no round count but 20."""
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        got = f"{len(key)} bytes" if isinstance(key, (bytes, bytearray)) else type(key).__name__
        raise ValueError(f"the key must be {KEY_BYTES} bytes, not {got}")
    if not isinstance(rounds, int) or rounds <= 0 or rounds % 2:
        raise ValueError(f"ChaCha's rounds come in column + diagonal pairs: a positive even int, not {rounds!r}")
    if first < 0 or blocks < 0 or first + blocks > 2**64:
        raise ValueError(f"blocks {first} .. {first + blocks - 1} are not in ChaCha's 64-bit counter range")
    counter = np.arange(first, first + blocks, dtype=np.uint64)
    state = np.empty((16, blocks), dtype=np.uint32)
    state[:4] = np.array([0x61707865, 0x3320646E, 0x79622D32, 0x6B206574], dtype=np.uint32)[:, None]
    state[4:12] = np.frombuffer(bytes(key), dtype="<u4")[:, None]
    state[12], state[13] = counter & np.uint64(0xFFFFFFFF), counter >> np.uint64(32)
    state[14:] = 0
    x = state.copy()

    def quarter(a: int, b: int, c: int, d: int) -> None:
        for p, q, r, shift in ((a, b, d, 16), (c, d, b, 12), (a, b, d, 8), (c, d, b, 7)):
            x[p] += x[q]
            v = x[r] ^ x[p]
            x[r] = (v << np.uint32(shift)) | (v >> np.uint32(32 - shift))

    for _ in range(rounds // 2):
        for column in range(4):
            quarter(column, 4 + column, 8 + column, 12 + column)
        for diagonal in range(4):
            quarter(diagonal, 4 + (diagonal + 1) % 4, 8 + (diagonal + 2) % 4, 12 + (diagonal + 3) % 4)
    return (x + state).T.copy()


def gaussian(shape: tuple[int, ...] | torch.Size, stream: NoiseStream) -> torch.Tensor:
    """Standard normal float32 values by Box-Muller on 23-bit uniforms from the stream: fast, vectorised
    (multi-threaded by torch), but a floating-point sampler, not an exact one."""
    n = math.prod(shape)
    half = (n + 1) // 2
    words = torch.frombuffer(bytearray(stream.random_bytes(8 * half)), dtype=torch.int32)
    # 23 random bits as the mantissa of a float in [1, 2): exact, and no int-to-float conversion
    u = (((words >> 9) & 0x7FFFFF) | 0x3F800000).view(torch.float32)
    radius = (2.0 - u[:half]).log_().mul_(-2.0).sqrt_()  # 2 - u is in (0, 1]: log never sees 0
    angle = u[half:].sub(1.0).mul_(2.0 * math.pi)
    pairs = torch.view_as_real(torch.polar(radius, angle))  # (r cos a, r sin a), one kernel for both
    return pairs.reshape(-1)[:n].reshape(tuple(shape))

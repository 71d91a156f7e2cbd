"""Chain keys: the name of a block is a hash of every token before and in it, the model, the KV
dtype, the block size and the request's cache salt.

A block is found only by its chain key, so a match is always state computed from exactly this
prompt's tokens. A request's public prefix (`public_prefix_tokens`, operator-marked) is keyed
without its salt, so every tenant shares it; the first block after it chains from a key that
mixes in the salt, so nothing private is ever found across tenants (see `chain`).
"""

from __future__ import annotations

from kvshare import _core
from kvshare.engine.sequence import Sequence


class BlockKeys:
    def __init__(self, fingerprint: bytes, kv_dtype: str, block_size: int,
                 public_prefixes: bool = True):
        self.fingerprint = fingerprint
        self.kv_dtype = kv_dtype
        self.block_size = block_size
        # Hybrids keep one root: their checkpoints are keyed from it, so public prefixes are
        # not shared across tenants for them.
        self.public_prefixes = public_prefixes
        self._roots: dict[bytes | None, bytes] = {}

    def root_key(self, salt: bytes | None) -> bytes:
        root = self._roots.get(salt)
        if root is None:
            root = _core.root_key(self.fingerprint, self.kv_dtype, self.block_size, salt)
            self._roots[salt] = root
        return root

    def chain(self, seq: Sequence) -> tuple[bytes, int, bytes | None]:
        """How the sequence's chain of block keys starts: (the root block 0 chains from, the
        index p of its first private block, the parent key of block p). Without a public
        prefix (or a salt) p is 0 and everything chains from the salted root. With one, the
        p full public blocks chain from the unsalted root and block p from a key derived from
        block p-1's key and the salt."""
        if seq.chain is None:
            bs = self.block_size
            salt = seq.request.cache_salt
            p = 0
            if salt is not None and self.public_prefixes:
                p = min(max(0, int(seq.request.public_prefix_tokens)), seq.n_prompt) // bs
            if p == 0:
                seq.chain = (self.root_key(salt), 0, None)
            else:
                public = self.root_key(None)
                last = _core.hash_blocks(public, seq.tokens[: p * bs], bs)[-1]
                seq.chain = (public, p, _core.root_key(last, self.kv_dtype, bs, salt))
        return seq.chain

    def parent(self, seq: Sequence, j: int) -> bytes:
        """The key block j of the sequence chains from (its keys up to j-1 computed)."""
        root, p, split = self.chain(seq)
        if j == 0:
            return root
        if j == p:
            assert split is not None  # p > 0 here (j == 0 returned): chain() derived its parent
            return split
        return seq.block_keys[j - 1]

    def ensure(self, seq: Sequence, upto: int) -> None:
        """Compute chain keys of every full block within tokens[:upto]."""
        bs = self.block_size
        have = len(seq.block_keys)
        need = upto // bs
        _, p, _ = self.chain(seq)
        while have < need:  # in two runs when the public prefix ends inside [have, need)
            end = p if have < p < need else need
            parent = self.parent(seq, have)
            seq.block_keys.extend(_core.hash_blocks(parent, seq.tokens[have * bs : end * bs], bs))
            have = end

//! Chain hashing: blake3 keys for full blocks and for arbitrary prefix positions.
//!
//! A key names the exact token prefix (and model, KV dtype, block size, salt) whose KV state a
//! block or checkpoint holds. Keys cross process and disk boundaries, so they are cryptographic
//! (blake3, 256 bit): a collision would hand one user another user's state.
//!
//! Every hash input starts with a distinct domain tag (`kvshare/<kind>/v1\0`) and every
//! variable-length field is length-prefixed (u64 little endian), so no two different inputs of
//! any kinds serialize to the same byte string:
//!
//! - root:    `ROOT  | len+fingerprint | len+kv_dtype | block_size u32 | salt flag u8 [| len+salt]`
//! - full:    `FULL  | parent[32] | n_tokens u64 | tokens (u32 LE each) | len+extra`
//! - partial: `PART  | parent[32] | n_tokens u64 | tokens (u32 LE each) | len+extra`
//!
//! `prefix_key(n)` chains `full` over every full block of `tokens[..n]` and, when `n` is not
//! block aligned, one `partial` step over the tail, so the key of a partial prefix can never equal
//! the key of a full block (or of a different partial prefix).

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::hash::{BuildHasherDefault, Hash, Hasher};

const TAG_ROOT: &[u8] = b"kvshare/root/v1\0";
const TAG_FULL: &[u8] = b"kvshare/full/v1\0";
const TAG_PARTIAL: &[u8] = b"kvshare/partial/v1\0";

/// A 256-bit chain key (blake3). `Debug`/`Display` print lowercase hex.
/// Serialized (serde) as a 32-byte byte string (msgpack `bin 8`), not as an array of ints.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct BlockKey(pub [u8; 32]);

impl BlockKey {
    pub const LEN: usize = 32;

    /// Build a key from exactly 32 bytes (`None` for any other length).
    pub fn from_slice(bytes: &[u8]) -> Option<BlockKey> {
        <[u8; 32]>::try_from(bytes).ok().map(BlockKey)
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    pub fn to_hex(&self) -> String {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut s = String::with_capacity(64);
        for b in self.0 {
            s.push(HEX[(b >> 4) as usize] as char);
            s.push(HEX[(b & 15) as usize] as char);
        }
        s
    }

    /// Parse 64 hex digits (either case).
    pub fn from_hex(hex: &str) -> Option<BlockKey> {
        let h = hex.as_bytes();
        if h.len() != 64 {
            return None;
        }
        let nib = |c: u8| -> Option<u8> {
            match c {
                b'0'..=b'9' => Some(c - b'0'),
                b'a'..=b'f' => Some(c - b'a' + 10),
                b'A'..=b'F' => Some(c - b'A' + 10),
                _ => None,
            }
        };
        let mut out = [0u8; 32];
        for (i, o) in out.iter_mut().enumerate() {
            *o = (nib(h[2 * i])? << 4) | nib(h[2 * i + 1])?;
        }
        Some(BlockKey(out))
    }
}

impl Serialize for BlockKey {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for BlockKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<BlockKey, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = BlockKey;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("32 bytes")
            }
            fn visit_bytes<E: serde::de::Error>(
                self,
                v: &[u8],
            ) -> std::result::Result<BlockKey, E> {
                BlockKey::from_slice(v).ok_or_else(|| E::invalid_length(v.len(), &self))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> std::result::Result<BlockKey, A::Error> {
                let mut out = [0u8; 32];
                for (i, o) in out.iter_mut().enumerate() {
                    *o = seq
                        .next_element()?
                        .ok_or_else(|| serde::de::Error::invalid_length(i, &self))?;
                }
                if seq.next_element::<u8>()?.is_some() {
                    return Err(serde::de::Error::invalid_length(33, &self));
                }
                Ok(BlockKey(out))
            }
        }
        d.deserialize_bytes(V)
    }
}

impl Hash for BlockKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write(&self.0);
    }
}

impl fmt::Debug for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockKey({})", self.to_hex())
    }
}

impl fmt::Display for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// Hasher for maps keyed by [`BlockKey`]: the key is already a uniform cryptographic hash, so
/// its first 8 bytes are used as is (no SipHash round over 32 bytes on every lookup).
#[derive(Default, Clone, Copy)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        if bytes.len() >= 8 {
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[..8]);
            self.0 ^= u64::from_le_bytes(w);
        } else {
            // Not reached for BlockKey; keep any other use well defined.
            for &b in bytes {
                self.0 = self.0.rotate_left(8) ^ u64::from(b);
            }
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 ^= v;
    }
}

pub type BuildKeyHasher = BuildHasherDefault<KeyHasher>;
/// `HashMap` keyed by [`BlockKey`] with the pass-through [`KeyHasher`].
pub type KeyMap<V> = HashMap<BlockKey, V, BuildKeyHasher>;
/// `HashSet` of [`BlockKey`] with the pass-through [`KeyHasher`].
pub type KeySet = HashSet<BlockKey, BuildKeyHasher>;

#[inline]
fn put_len(h: &mut blake3::Hasher, n: usize) {
    h.update(&(n as u64).to_le_bytes());
}

#[inline]
fn put_field(h: &mut blake3::Hasher, bytes: &[u8]) {
    put_len(h, bytes.len());
    h.update(bytes);
}

#[inline]
fn finish(h: &blake3::Hasher) -> BlockKey {
    BlockKey(*h.finalize().as_bytes())
}

/// The root of every chain: model fingerprint (content hash of the weights + arch), KV dtype,
/// block size and an optional per-request `cache_salt` (tenant isolation). `None` and
/// `Some(b"")` give different roots.
pub fn root_key(
    model_fingerprint: &[u8],
    kv_dtype: &str,
    block_size: u32,
    cache_salt: Option<&[u8]>,
) -> BlockKey {
    let mut h = blake3::Hasher::new();
    h.update(TAG_ROOT);
    put_field(&mut h, model_fingerprint);
    put_field(&mut h, kv_dtype.as_bytes());
    h.update(&block_size.to_le_bytes());
    match cache_salt {
        None => {
            h.update(&[0u8]);
        }
        Some(s) => {
            h.update(&[1u8]);
            put_field(&mut h, s);
        }
    }
    finish(&h)
}

fn chain(tag: &[u8], parent: &BlockKey, tokens: &[u32], extra: &[u8]) -> BlockKey {
    // Serialize into one contiguous buffer and hash it with a single call: for a 16-token block
    // this is 128 bytes (one blake3 chunk), about twice as fast as streaming the fields.
    let len = tag.len() + 32 + 8 + 4 * tokens.len() + 8 + extra.len();
    let mut stack = [0u8; 512];
    let mut heap = Vec::new();
    let buf: &mut [u8] = if len <= stack.len() {
        &mut stack[..len]
    } else {
        heap.resize(len, 0);
        &mut heap
    };
    let mut at = 0;
    let mut put = |bytes: &[u8]| {
        buf[at..at + bytes.len()].copy_from_slice(bytes);
        at += bytes.len();
    };
    put(tag);
    put(&parent.0);
    put(&(tokens.len() as u64).to_le_bytes());
    for t in tokens {
        put(&t.to_le_bytes());
    }
    put(&(extra.len() as u64).to_le_bytes());
    put(extra);
    BlockKey(*blake3::hash(buf).as_bytes())
}

/// Key of a FULL block: `H(parent, tokens, extra)`. `extra` is per-block content that is not a
/// token id (e.g. a multimodal embedding hash); pass `&[]` when there is none.
pub fn chain_key(parent: &BlockKey, tokens: &[u32], extra: &[u8]) -> BlockKey {
    chain(TAG_FULL, parent, tokens, extra)
}

/// Key of a partial tail (fewer than `block_size` tokens) after `parent`. Domain separated from
/// [`chain_key`], so a partial prefix never shares a key with a full block.
pub fn partial_key(parent: &BlockKey, tail: &[u32], extra: &[u8]) -> BlockKey {
    chain(TAG_PARTIAL, parent, tail, extra)
}

/// Keys of all FULL blocks of `tokens` (`tokens.len() / block_size` keys), each chained on the
/// previous one, the first on `root`. Panics if `block_size == 0`.
pub fn hash_blocks(
    root: &BlockKey,
    tokens: &[u32],
    block_size: usize,
    extra: &[u8],
) -> Vec<BlockKey> {
    assert!(block_size > 0, "block_size must be > 0");
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    let mut parent = *root;
    for block in tokens.chunks_exact(block_size) {
        parent = chain_key(&parent, block, extra);
        out.push(parent);
    }
    out
}

/// Key of the prefix `tokens` (position `n = tokens.len()`): the last full-block key when `n` is
/// block aligned (`root` for `n == 0`), else one [`partial_key`] step over the tail after it.
/// Panics if `block_size == 0`.
pub fn prefix_key(root: &BlockKey, tokens: &[u32], block_size: usize, extra: &[u8]) -> BlockKey {
    let (anchor, tail) = anchor_and_tail(root, tokens, block_size, extra);
    if tail.is_empty() {
        anchor
    } else {
        partial_key(&anchor, tail, extra)
    }
}

/// The key of the last full block at or before `tokens.len()` (`root` if none) and the tokens
/// after it (fewer than `block_size`). Panics if `block_size == 0`.
pub fn anchor_and_tail<'a>(
    root: &BlockKey,
    tokens: &'a [u32],
    block_size: usize,
    extra: &[u8],
) -> (BlockKey, &'a [u32]) {
    assert!(block_size > 0, "block_size must be > 0");
    let n_full = tokens.len() / block_size * block_size;
    let mut anchor = *root;
    for block in tokens[..n_full].chunks_exact(block_size) {
        anchor = chain_key(&anchor, block, extra);
    }
    (anchor, &tokens[n_full..])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> BlockKey {
        root_key(b"model", "f16", 4, None)
    }

    #[test]
    fn hex_roundtrip_and_debug() {
        let k = root();
        assert_eq!(BlockKey::from_hex(&k.to_hex()), Some(k));
        assert!(format!("{k:?}").starts_with("BlockKey("));
        assert_eq!(format!("{k}").len(), 64);
        assert_eq!(BlockKey::from_slice(&[1u8; 31]), None);
        assert_eq!(BlockKey::from_hex("zz"), None);
    }

    #[test]
    fn root_fields_are_separated() {
        let base = root_key(b"model", "f16", 16, None);
        assert_ne!(base, root_key(b"model", "f16", 16, Some(b"")));
        assert_ne!(base, root_key(b"model", "bf16", 16, None));
        assert_ne!(base, root_key(b"model", "f16", 32, None));
        assert_ne!(base, root_key(b"mode", "lf16", 16, None));
        assert_ne!(
            root_key(b"m", "f16", 16, Some(b"a")),
            root_key(b"m", "f16", 16, Some(b"b"))
        );
        assert_eq!(base, root_key(b"model", "f16", 16, None));
    }

    #[test]
    fn blocks_chain_and_prefix_agree() {
        let r = root();
        let toks: Vec<u32> = (0..11).collect();
        let keys = hash_blocks(&r, &toks, 4, b"");
        assert_eq!(keys.len(), 2);
        assert_eq!(keys[0], chain_key(&r, &toks[..4], b""));
        assert_eq!(keys[1], chain_key(&keys[0], &toks[4..8], b""));
        assert_eq!(prefix_key(&r, &toks[..0], 4, b""), r);
        assert_eq!(prefix_key(&r, &toks[..8], 4, b""), keys[1]);
        assert_eq!(
            prefix_key(&r, &toks, 4, b""),
            partial_key(&keys[1], &toks[8..], b"")
        );
        // partial and full are domain separated
        assert_ne!(partial_key(&r, &toks[..4], b""), keys[0]);
        // extra changes keys
        assert_ne!(hash_blocks(&r, &toks, 4, b"x")[0], keys[0]);
    }
}

//! Values of the shared (remote) tier: one KV block or one recurrent-state checkpoint per
//! value, self-describing and checksummed, so that a store we do not control (Redis, Valkey)
//! can never hand us bytes we would use wrongly.
//!
//! The rules are the disk store's (`disk::format`): a magic and version, a blake3 checksum
//! over everything after it, the model fingerprint (which also binds the KV dtype and block
//! size) and the content key the value is stored under. A value is one block rather than a
//! disk entry's whole prefix because a remote store is addressed per key: replicas then share
//! a tool prefix's blocks whatever conversation wrote them, and fetch only the blocks they lack.
//!
//! Layout (little-endian):
//! `MAGIC (8) | blake3(body) (32) | body`, body =
//! `kind u8 | fingerprint [32] | key [32] | position u64 | layout_len u16 | layout (utf-8) |
//! payload_len u64 | payload`.
//!
//! Decoding checks, in order: length and magic, checksum, kind, fingerprint, key, lengths
//! (no trailing bytes). Any failure is `CorruptEntry` except a fingerprint of another model,
//! which is `FingerprintMismatch` (not ours: a miss, not damage).

use crate::error::{CoreError, Result};

/// First bytes of every value (the last byte is the format version).
pub const VALUE_MAGIC: &[u8; 8] = b"KVSRV\x00\x00\x01";
const HEAD: usize = 8 + 32;

/// What a value holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueKind {
    /// A full KV block's bytes (the pool's block layout), stored under its chain key.
    Block = 1,
    /// A recurrent-state checkpoint, stored under the chain key of the block it ends at.
    Checkpoint = 2,
}

impl ValueKind {
    pub fn parse(s: &str) -> Result<ValueKind> {
        match s {
            "block" => Ok(ValueKind::Block),
            "checkpoint" => Ok(ValueKind::Checkpoint),
            _ => Err(CoreError::InvalidArgument(format!(
                "value kind must be 'block' or 'checkpoint', not {s:?}"
            ))),
        }
    }
}

/// What a decoded value says about its payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValueMeta {
    /// Token position (checkpoints: where the state is; blocks: 0).
    pub position: u64,
    /// The checkpoint's layout string (blocks: empty).
    pub layout: String,
}

/// Encodes `payload` as a value of `kind` stored under `key`.
pub fn encode_value(
    kind: ValueKind,
    fingerprint: &[u8; 32],
    key: &[u8; 32],
    meta: &ValueMeta,
    payload: &[u8],
) -> Result<Vec<u8>> {
    let layout = meta.layout.as_bytes();
    let layout_len = u16::try_from(layout.len())
        .map_err(|_| CoreError::InvalidArgument("layout longer than 65535 bytes".into()))?;
    let body_len = 1 + 32 + 32 + 8 + 2 + layout.len() + 8 + payload.len();
    let mut out = Vec::with_capacity(HEAD + body_len);
    out.extend_from_slice(VALUE_MAGIC);
    out.extend_from_slice(&[0u8; 32]); // checksum, filled below
    out.push(kind as u8);
    out.extend_from_slice(fingerprint);
    out.extend_from_slice(key);
    out.extend_from_slice(&meta.position.to_le_bytes());
    out.extend_from_slice(&layout_len.to_le_bytes());
    out.extend_from_slice(layout);
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(payload);
    let sum = blake3::hash(&out[HEAD..]);
    out[8..HEAD].copy_from_slice(sum.as_bytes());
    Ok(out)
}

fn corrupt(what: &str) -> CoreError {
    CoreError::CorruptEntry(format!("remote value: {what}"))
}

/// Reads `n` bytes at `*at`, advancing it; `CorruptEntry` past the end.
fn take<'a>(body: &'a [u8], at: &mut usize, n: usize) -> Result<&'a [u8]> {
    let end = at.checked_add(n).filter(|&e| e <= body.len());
    let end = end.ok_or_else(|| corrupt("truncated"))?;
    let got = &body[*at..end];
    *at = end;
    Ok(got)
}

/// Checks a value read back from under `key` and returns its metadata and payload.
pub fn decode_value<'a>(
    value: &'a [u8],
    kind: ValueKind,
    fingerprint: &[u8; 32],
    key: &[u8; 32],
) -> Result<(ValueMeta, &'a [u8])> {
    if value.len() < HEAD || &value[..8] != VALUE_MAGIC {
        return Err(corrupt("bad magic or truncated"));
    }
    let body = &value[HEAD..];
    if blake3::hash(body).as_bytes() != &value[8..HEAD] {
        return Err(corrupt("checksum mismatch"));
    }
    let mut at = 0;
    if take(body, &mut at, 1)?[0] != kind as u8 {
        return Err(corrupt("wrong kind"));
    }
    if take(body, &mut at, 32)? != fingerprint {
        return Err(CoreError::FingerprintMismatch(
            "remote value of another model".into(),
        ));
    }
    if take(body, &mut at, 32)? != key {
        return Err(corrupt("stored under another key"));
    }
    let position = u64::from_le_bytes(take(body, &mut at, 8)?.try_into().unwrap());
    let layout_len = u16::from_le_bytes(take(body, &mut at, 2)?.try_into().unwrap()) as usize;
    let layout = std::str::from_utf8(take(body, &mut at, layout_len)?)
        .map_err(|_| corrupt("layout is not utf-8"))?
        .to_owned();
    let n = u64::from_le_bytes(take(body, &mut at, 8)?.try_into().unwrap());
    let n = usize::try_from(n).map_err(|_| corrupt("payload length"))?;
    let payload = take(body, &mut at, n)?;
    if at != body.len() {
        return Err(corrupt("trailing bytes"));
    }
    Ok((ValueMeta { position, layout }, payload))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const FP: [u8; 32] = [7; 32];
    const KEY: [u8; 32] = [9; 32];

    fn meta(position: u64, layout: &str) -> ValueMeta {
        ValueMeta {
            position,
            layout: layout.into(),
        }
    }

    #[test]
    fn round_trip_block_and_checkpoint() {
        let v = encode_value(ValueKind::Block, &FP, &KEY, &meta(0, ""), b"abc").unwrap();
        let (m, p) = decode_value(&v, ValueKind::Block, &FP, &KEY).unwrap();
        assert_eq!((m, p), (meta(0, ""), &b"abc"[..]));
        let v = encode_value(
            ValueKind::Checkpoint,
            &FP,
            &KEY,
            &meta(512, "f32:2x3"),
            &[1; 24],
        )
        .unwrap();
        let (m, p) = decode_value(&v, ValueKind::Checkpoint, &FP, &KEY).unwrap();
        assert_eq!(m, meta(512, "f32:2x3"));
        assert_eq!(p, &[1u8; 24][..]);
    }

    #[test]
    fn wrong_kind_key_or_model_is_refused() {
        let v = encode_value(ValueKind::Block, &FP, &KEY, &meta(0, ""), b"abc").unwrap();
        let e = decode_value(&v, ValueKind::Checkpoint, &FP, &KEY).unwrap_err();
        assert!(matches!(e, CoreError::CorruptEntry(_)), "{e}");
        let e = decode_value(&v, ValueKind::Block, &FP, &[0; 32]).unwrap_err();
        assert!(matches!(e, CoreError::CorruptEntry(_)), "{e}");
        let e = decode_value(&v, ValueKind::Block, &[0; 32], &KEY).unwrap_err();
        assert!(matches!(e, CoreError::FingerprintMismatch(_)), "{e}");
    }

    proptest! {
        // Any single flipped bit, and any truncation, is detected.
        #[test]
        fn damage_is_detected(payload in proptest::collection::vec(any::<u8>(), 0..300),
                              bit in any::<prop::sample::Index>(),
                              cut in any::<prop::sample::Index>()) {
            let v = encode_value(ValueKind::Block, &FP, &KEY, &meta(0, "x"), &payload).unwrap();
            let mut flipped = v.clone();
            let i = bit.index(v.len() * 8);
            flipped[i / 8] ^= 1 << (i % 8);
            prop_assert!(decode_value(&flipped, ValueKind::Block, &FP, &KEY).is_err());
            let short = &v[..cut.index(v.len())];
            prop_assert!(decode_value(short, ValueKind::Block, &FP, &KEY).is_err());
            let mut long = v.clone();
            long.push(0);
            prop_assert!(decode_value(&long, ValueKind::Block, &FP, &KEY).is_err());
        }
    }
}

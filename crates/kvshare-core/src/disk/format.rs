//! On-disk formats of the disk store: file names, the `.idx` commit record (msgpack via
//! rmp-serde behind a magic and a blake3 checksum of its body), and hex keys.
//!
//! An `.idx` file is `MAGIC (8 bytes) | blake3(body) (32 bytes) | body (msgpack, named fields)`.
//! The checksum makes a bit flip anywhere in the record (a block key, an offset, a payload
//! checksum) detectable, so a damaged index can never map a key to someone else's bytes.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::de::{self, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{CoreError, Result};

/// First bytes of every `.idx` file.
pub const IDX_MAGIC: &[u8; 8] = b"KVSIDX\x00\x01";
/// Version of the `.idx` body; a reader rejects (and the sweep removes) any other.
pub const FORMAT_VERSION: u32 = 1;

/// File kinds of an entry. Names are `<64 hex>.<ext>`; in-progress files add `.tmp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ext {
    Kv,
    Ckpt,
    Idx,
}

impl Ext {
    pub fn as_str(self) -> &'static str {
        match self {
            Ext::Kv => "kv",
            Ext::Ckpt => "ckpt",
            Ext::Idx => "idx",
        }
    }
}

/// Lower-case hex of a 32-byte key.
pub fn hex32(key: &[u8; 32]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(64);
    for b in key {
        s.push(HEX[(b >> 4) as usize] as char);
        s.push(HEX[(b & 15) as usize] as char);
    }
    s
}

/// Parses exactly 64 lower-case hex digits.
pub fn parse_hex32(s: &str) -> Option<[u8; 32]> {
    let b = s.as_bytes();
    if b.len() != 64 {
        return None;
    }
    let nib = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let mut out = [0u8; 32];
    for i in 0..32 {
        out[i] = (nib(b[2 * i])? << 4) | nib(b[2 * i + 1])?;
    }
    Some(out)
}

/// What a directory entry's name says it is.
#[derive(Debug, PartialEq, Eq)]
pub enum FileName {
    /// `<key>.<ext>`
    Final([u8; 32], Ext),
    /// `<key>.<ext>.tmp`
    Tmp,
    /// Anything else: not ours, never touched.
    Other,
}

pub fn classify(name: &str) -> FileName {
    let (base, tmp) = match name.strip_suffix(".tmp") {
        Some(b) => (b, true),
        None => (name, false),
    };
    let Some((stem, ext)) = base.split_once('.') else {
        return FileName::Other;
    };
    let ext = match ext {
        "kv" => Ext::Kv,
        "ckpt" => Ext::Ckpt,
        "idx" => Ext::Idx,
        _ => return FileName::Other,
    };
    let Some(key) = parse_hex32(stem) else {
        return FileName::Other;
    };
    if tmp {
        FileName::Tmp
    } else {
        FileName::Final(key, ext)
    }
}

/// Joins `name` onto the (canonical) cache dir, refusing anything that could leave it: the
/// name must be a single component of `[0-9a-z.]` that is not `.`/`..`, and the result's parent
/// must be `dir` itself. Every path the store touches goes through here.
pub fn checked_join(dir: &Path, name: &str) -> Result<PathBuf> {
    let ok_chars = !name.is_empty()
        && name
            .bytes()
            .all(|c| c.is_ascii_digit() || c.is_ascii_lowercase() || c == b'.')
        && name != "."
        && name != ".."
        && !name.starts_with("..");
    if !ok_chars {
        return Err(CoreError::PathEscape(format!(
            "{name:?} is not a cache file name"
        )));
    }
    let p = dir.join(name);
    if p.parent() != Some(dir) {
        return Err(CoreError::PathEscape(format!(
            "{} is outside {}",
            p.display(),
            dir.display()
        )));
    }
    Ok(p)
}

/// Path of an entry's file, or of its `.tmp` sibling.
pub fn entry_path(dir: &Path, key: &[u8; 32], ext: Ext, tmp: bool) -> Result<PathBuf> {
    let mut name = format!("{}.{}", hex32(key), ext.as_str());
    if tmp {
        name.push_str(".tmp");
    }
    checked_join(dir, &name)
}

/// A 32-byte key serialized as msgpack bin (not as an array of 32 integers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct K32(pub [u8; 32]);

impl Serialize for K32 {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

struct BytesVisitor;
impl<'de> Visitor<'de> for BytesVisitor {
    type Value = Vec<u8>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("bytes")
    }
    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> std::result::Result<Vec<u8>, E> {
        Ok(v.to_vec())
    }
    fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> std::result::Result<Vec<u8>, E> {
        Ok(v)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> std::result::Result<Vec<u8>, A::Error> {
        let mut v = Vec::new();
        while let Some(b) = a.next_element::<u8>()? {
            v.push(b);
        }
        Ok(v)
    }
}

impl<'de> Deserialize<'de> for K32 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let v = d.deserialize_bytes(BytesVisitor)?;
        let arr: [u8; 32] = v
            .try_into()
            .map_err(|_| de::Error::custom("key is not 32 bytes"))?;
        Ok(K32(arr))
    }
}

/// A byte string serialized as msgpack bin.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Blob(pub Vec<u8>);

impl Serialize for Blob {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}
impl<'de> Deserialize<'de> for Blob {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        Ok(Blob(d.deserialize_bytes(BytesVisitor)?))
    }
}

/// Where a payload region lives: in the `.kv` (blocks) or `.ckpt` (checkpoints) file of entry
/// `file` (this entry or one it extends), at `offset..offset+len`, with blake3 `hash`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdxRegion {
    pub key: K32,
    pub file: K32,
    pub offset: u64,
    pub len: u64,
    pub hash: K32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdxCheckpoint {
    pub position: u64,
    pub layout: String,
    pub region: IdxRegion,
}

/// The commit record of one entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdxFile {
    pub version: u32,
    pub fingerprint: Blob,
    /// The entry's own key (must equal the file name's).
    pub key: K32,
    pub tokens: u64,
    pub created_ms: u64,
    pub last_access_ms: u64,
    /// Exact sizes of this entry's own `.kv` and `.ckpt` (0: the file does not exist).
    pub kv_len: u64,
    pub ckpt_len: u64,
    /// Other entries whose files this one references (it extends them).
    pub deps: Vec<K32>,
    /// Ordered blocks of the prefix this entry covers.
    pub blocks: Vec<IdxRegion>,
    pub checkpoints: Vec<IdxCheckpoint>,
}

pub fn encode_idx(idx: &IdxFile) -> Vec<u8> {
    let body = rmp_serde::to_vec_named(idx).expect("msgpack encoding of an IdxFile cannot fail");
    let mut out = Vec::with_capacity(40 + body.len());
    out.extend_from_slice(IDX_MAGIC);
    out.extend_from_slice(blake3::hash(&body).as_bytes());
    out.extend_from_slice(&body);
    out
}

/// Decodes and checks an `.idx` file: `CorruptEntry` for a bad magic, checksum, body or
/// version; `FingerprintMismatch` when it belongs to another model.
pub fn decode_idx(bytes: &[u8], fingerprint: &[u8]) -> Result<IdxFile> {
    if bytes.len() < 40 || &bytes[..8] != IDX_MAGIC {
        return Err(CoreError::CorruptEntry(
            "index: bad magic or truncated".into(),
        ));
    }
    let body = &bytes[40..];
    if blake3::hash(body).as_bytes() != &bytes[8..40] {
        return Err(CoreError::CorruptEntry("index: checksum mismatch".into()));
    }
    let idx: IdxFile = rmp_serde::from_slice(body)
        .map_err(|e| CoreError::CorruptEntry(format!("index: cannot decode: {e}")))?;
    if idx.version != FORMAT_VERSION {
        return Err(CoreError::CorruptEntry(format!(
            "index: unknown version {}",
            idx.version
        )));
    }
    if idx.fingerprint.0 != fingerprint {
        return Err(CoreError::FingerprintMismatch(format!(
            "entry {}",
            hex32(&idx.key.0)
        )));
    }
    Ok(idx)
}

/// Content-addressed entry key: the model fingerprint, token count, block keys and checkpoint
/// keys. Identical submissions get the same key (and are written once); different models never
/// share a file name.
pub fn entry_key(
    fingerprint: &[u8],
    tokens: u64,
    blocks: &[[u8; 32]],
    ckpts: &[[u8; 32]],
) -> [u8; 32] {
    let mut h = blake3::Hasher::new_derive_key("kvshare disk entry v1");
    h.update(&(fingerprint.len() as u64).to_le_bytes());
    h.update(fingerprint);
    h.update(&tokens.to_le_bytes());
    h.update(&(blocks.len() as u64).to_le_bytes());
    for k in blocks {
        h.update(k);
    }
    h.update(&(ckpts.len() as u64).to_le_bytes());
    for k in ckpts {
        h.update(k);
    }
    *h.finalize().as_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip_and_names() {
        let k = [0xabu8; 32];
        let h = hex32(&k);
        assert_eq!(parse_hex32(&h), Some(k));
        assert_eq!(classify(&format!("{h}.kv")), FileName::Final(k, Ext::Kv));
        assert_eq!(classify(&format!("{h}.idx.tmp")), FileName::Tmp);
        assert_eq!(classify("notes.txt"), FileName::Other);
        assert_eq!(
            classify(&format!("{}.kv", h.to_uppercase())),
            FileName::Other
        );
    }

    #[test]
    fn checked_join_refuses_escapes() {
        let d = Path::new("/cache");
        assert!(checked_join(d, "ab.kv").is_ok());
        for bad in ["../x", "..", ".", "a/b", "/etc/passwd", "", "A.kv", "..kv"] {
            assert!(
                matches!(checked_join(d, bad), Err(CoreError::PathEscape(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn idx_round_trip_and_damage() {
        let r = IdxRegion {
            key: K32([1; 32]),
            file: K32([2; 32]),
            offset: 3,
            len: 4,
            hash: K32([5; 32]),
        };
        let idx = IdxFile {
            version: FORMAT_VERSION,
            fingerprint: Blob(b"fp".to_vec()),
            key: K32([9; 32]),
            tokens: 77,
            created_ms: 1,
            last_access_ms: 2,
            kv_len: 4,
            ckpt_len: 0,
            deps: vec![K32([2; 32])],
            blocks: vec![r.clone()],
            checkpoints: vec![IdxCheckpoint {
                position: 16,
                layout: "f32[4]".into(),
                region: r,
            }],
        };
        let bytes = encode_idx(&idx);
        assert_eq!(decode_idx(&bytes, b"fp").unwrap(), idx);
        assert!(matches!(
            decode_idx(&bytes, b"other"),
            Err(CoreError::FingerprintMismatch(_))
        ));
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x10;
            assert!(decode_idx(&b, b"fp").is_err(), "flip at {i} undetected");
        }
        for n in 0..bytes.len() {
            assert!(
                decode_idx(&bytes[..n], b"fp").is_err(),
                "truncation to {n} undetected"
            );
        }
    }
}

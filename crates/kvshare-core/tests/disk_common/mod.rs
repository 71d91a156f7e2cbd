//! Deterministic test content for the disk-store tests, shared by the integration tests and
//! the `disk_crash_writer` helper binary (which includes this file by path). Every payload is
//! a pure function of its key, so any bytes a store returns can be checked independently.
#![allow(dead_code)]

use std::sync::Arc;

use kvshare_core::disk::{Key, NewCheckpoint, NewEntry};

pub const FP: &[u8] = b"test-model-fingerprint";
pub const TOKENS_PER_BLOCK: u64 = 16;

/// Chain keys of test prompt `chain`: key i depends on key i-1 (like real chain hashes).
pub fn chain_keys(chain: u64, n: usize) -> Vec<Key> {
    let mut out = Vec::with_capacity(n);
    let mut prev = [0u8; 32];
    for i in 0..n {
        let mut h = blake3::Hasher::new_derive_key("kvshare test chain");
        h.update(&chain.to_le_bytes());
        h.update(&(i as u64).to_le_bytes());
        h.update(&prev);
        prev = *h.finalize().as_bytes();
        out.push(prev);
    }
    out
}

fn xof(ctx: &str, key: &Key, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    let mut h = blake3::Hasher::new_derive_key(ctx);
    h.update(key);
    h.finalize_xof().fill(&mut out);
    out
}

/// Payload length of a block (varies, so offsets are not all multiples of one size).
pub fn block_len(key: &Key) -> usize {
    96 + (key[0] as usize % 5) * 40
}

pub fn block_payload(key: &Key) -> Vec<u8> {
    xof("kvshare test block", key, block_len(key))
}

pub fn ckpt_data(key: &Key) -> Vec<u8> {
    xof("kvshare test checkpoint", key, 150 + key[1] as usize % 64)
}

pub fn ckpt_layout(key: &Key) -> String {
    format!("conv f32[{}]", key[2])
}

/// Entry of the first `n` blocks of `chain`, payload from block `payload_from` on, with a
/// checkpoint at the end of each block index in `ckpts` (keyed by that block's key).
pub fn make_entry(chain: u64, n: usize, payload_from: usize, ckpts: &[usize]) -> NewEntry {
    let keys = chain_keys(chain, n);
    let mut payload = Vec::new();
    let mut block_lens = Vec::new();
    for k in &keys[payload_from..] {
        let p = block_payload(k);
        block_lens.push(p.len() as u64);
        payload.extend_from_slice(&p);
    }
    let checkpoints = ckpts
        .iter()
        .filter(|&&i| i < n)
        .map(|&i| NewCheckpoint {
            position: (i as u64 + 1) * TOKENS_PER_BLOCK,
            key: keys[i],
            layout: ckpt_layout(&keys[i]),
            data: Arc::from(ckpt_data(&keys[i])),
        })
        .collect();
    NewEntry {
        block_keys: keys,
        payload_from,
        payload,
        block_lens,
        tokens: n as u64 * TOKENS_PER_BLOCK,
        checkpoints,
    }
}

/// Checks `bytes` is exactly the payloads of `keys`, back to back.
pub fn expected_blocks(keys: &[Key]) -> Vec<u8> {
    keys.iter().flat_map(block_payload).collect()
}

pub fn entry_key_of(e: &NewEntry) -> Key {
    let ck: Vec<Key> = e.checkpoints.iter().map(|c| c.key).collect();
    kvshare_core::disk::entry_key(FP, e.tokens, &e.block_keys, &ck)
}

/// Checks a store against the content functions above; returns the first violation.
/// - every committed entry is complete: all its blocks match by lookup and read back exactly,
///   all its checkpoints read back exactly;
/// - every chain in `chains` (up to `max_blocks`) matches a prefix whose bytes are exact;
/// - the directory holds exactly the committed entries' files (no `.tmp`, no orphans) and
///   their sizes add up to `bytes_on_disk`.
pub fn verify_store(
    store: &kvshare_core::disk::DiskStore,
    chains: &[u64],
    max_blocks: usize,
) -> Result<(), String> {
    use kvshare_core::disk::hex32;
    for info in store.entries() {
        let keys = store.entry_block_keys(&info.key).ok_or("entry vanished")?;
        let m = store.lookup(&keys).map_err(|e| e.to_string())?;
        if m.n_blocks != keys.len() {
            return Err(format!(
                "entry {} incomplete: {} of {} blocks",
                hex32(&info.key),
                m.n_blocks,
                keys.len()
            ));
        }
        let bytes = store
            .read_blocks_vec(&keys)
            .map_err(|e| format!("entry {}: {e}", hex32(&info.key)))?;
        if bytes != expected_blocks(&keys) {
            return Err(format!("entry {} returned wrong bytes", hex32(&info.key)));
        }
        for ck in store.entry_checkpoint_keys(&info.key).unwrap_or_default() {
            let c = store
                .read_checkpoint(&ck)
                .map_err(|e| e.to_string())?
                .ok_or("checkpoint of entry missing")?;
            if c.data != ckpt_data(&ck) || c.layout != ckpt_layout(&ck) {
                return Err("wrong checkpoint bytes".into());
            }
        }
    }
    for &chain in chains {
        let keys = chain_keys(chain, max_blocks);
        let m = store.lookup(&keys).map_err(|e| e.to_string())?;
        let want: Vec<u64> = keys[..m.n_blocks]
            .iter()
            .map(|k| block_len(k) as u64)
            .collect();
        if m.block_lens != want {
            return Err(format!("chain {chain}: wrong block lengths"));
        }
        let bytes = store
            .read_blocks_vec(&keys[..m.n_blocks])
            .map_err(|e| e.to_string())?;
        if bytes != expected_blocks(&keys[..m.n_blocks]) {
            return Err(format!("chain {chain}: wrong bytes"));
        }
        if let Some(c) = &m.checkpoint {
            let i = keys[..m.n_blocks]
                .iter()
                .position(|k| *k == c.key)
                .ok_or("checkpoint off the match")?;
            if c.position != (i as u64 + 1) * TOKENS_PER_BLOCK {
                return Err("checkpoint position".into());
            }
        }
    }
    let entries: std::collections::HashSet<String> =
        store.entries().iter().map(|e| hex32(&e.key)).collect();
    let mut total = 0u64;
    for de in std::fs::read_dir(store.dir()).map_err(|e| e.to_string())? {
        let de = de.map_err(|e| e.to_string())?;
        let name = de.file_name().to_string_lossy().into_owned();
        let ours = name.len() > 65
            && name.as_bytes()[64] == b'.'
            && kvshare_core::disk::parse_hex32(&name[..64]).is_some();
        if !ours {
            continue; // .lock and files that are not the store's
        }
        if name.ends_with(".tmp") {
            return Err(format!("leftover {name}"));
        }
        let stem = name.split('.').next().unwrap_or("");
        if !entries.contains(stem) {
            return Err(format!("orphan file {name}"));
        }
        total += de.metadata().map_err(|e| e.to_string())?.len();
    }
    let s = store.stats();
    if total != s.bytes_on_disk {
        return Err(format!(
            "files hold {total} bytes, stats say {}",
            s.bytes_on_disk
        ));
    }
    Ok(())
}

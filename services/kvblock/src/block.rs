//! Block identity and integrity (DESIGN.md section 2). A block is served only if its key is the
//! chain key of its own namespace, parent and token ids, its payload has the declared size and
//! checksum, and its layout is self-consistent. Anything else is refused or treated as a miss.

use std::fmt;

use prost::Message;
use prost::bytes::Bytes;
use strata_proto::kvcache::{Block, BlockHeader, StateKind};

/// Version of the block header and payload layout. 2: the payload checksum is XXH3-128 (1:
/// BLAKE3; blocks of another version are misses).
pub const FORMAT_VERSION: u32 = 2;

/// The payload's checksum: XXH3-128, little-endian. It guards against torn writes, bit rot and
/// a file that is not what the index says, which needs a good spread, not a cryptographic hash:
/// whoever can write the cache directory can rewrite any checksum too, and identity is the key
/// chain's job (BLAKE3). Every hit verifies every payload byte, so speed is the point: 14-23
/// GB/s on one core of the development machine against 3.1-3.6 for BLAKE3, that is 8 ms
/// instead of 55 ms of CPU for the 189 MB of a 4K-token SmolLM2 prefix.
pub fn payload_checksum(payload: &[u8]) -> [u8; 16] {
    xxhash_rust::xxh3::xxh3_128(payload).to_le_bytes()
}

/// BLAKE3(namespace || parent || token ids as u32 LE).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey(pub [u8; 32]);

impl BlockKey {
    pub fn chain(namespace: &str, parent: Option<&BlockKey>, tokens: &[u32]) -> Self {
        let mut h = blake3::Hasher::new();
        // Length-prefix the namespace so that no (namespace, tokens) pair collides with another.
        h.update(&(namespace.len() as u64).to_le_bytes());
        h.update(namespace.as_bytes());
        h.update(parent.map(|p| &p.0[..]).unwrap_or(&[0u8; 32]));
        for t in tokens {
            h.update(&t.to_le_bytes());
        }
        BlockKey(*h.finalize().as_bytes())
    }

    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        <[u8; 32]>::try_from(bytes).ok().map(BlockKey)
    }

    pub fn hex(&self) -> String {
        blake3::Hash::from_bytes(self.0).to_hex().to_string()
    }
}

impl fmt::Debug for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockKey({})", &self.hex()[..12])
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BlockError {
    #[error("block without header")]
    NoHeader,
    #[error("format version {0} (this service reads {FORMAT_VERSION})")]
    Version(u32),
    #[error("empty namespace")]
    NoNamespace,
    #[error("key is not 32 bytes")]
    BadKeyLength,
    #[error("key does not match namespace, parent and token ids")]
    KeyMismatch,
    #[error("payload has {got} bytes, header says {declared}")]
    SizeMismatch { got: u64, declared: u64 },
    #[error("payload size {declared} does not fit the layout ({expected} expected)")]
    LayoutMismatch { declared: u64, expected: u64 },
    #[error("payload checksum mismatch")]
    ChecksumMismatch,
    #[error("unknown dtype {0:?}")]
    Dtype(String),
    #[error("unknown or unusable KV quantisation {0:?}")]
    Quant(String),
}

/// Values per quantisation group (see `BlockHeader.kv_quant`).
pub const QUANT_GROUP: u64 = 64;

/// Bits per value of a quantisation scheme this service knows.
fn quant_bits(scheme: &str) -> Option<u64> {
    match scheme {
        "affine-q8-g64" => Some(8),
        "affine-q4-g64" => Some(4),
        _ => None,
    }
}

fn dtype_bytes(dtype: &str) -> Option<u64> {
    match dtype {
        "float32" => Some(4),
        "float16" | "bfloat16" => Some(2),
        _ => None,
    }
}

/// Checks everything a block claims about itself. Returns its key.
pub fn verify(block: &Block) -> Result<BlockKey, BlockError> {
    let h = block.header.as_ref().ok_or(BlockError::NoHeader)?;
    verify_header(h)?;
    let got = block.payload.len() as u64;
    if got != h.payload_bytes {
        return Err(BlockError::SizeMismatch {
            got,
            declared: h.payload_bytes,
        });
    }
    if payload_checksum(&block.payload)[..] != h.payload_checksum[..] {
        return Err(BlockError::ChecksumMismatch);
    }
    // The K/V part's own checksum must agree too, or a later read of that part alone would
    // trust other bytes than a whole read does.
    if !h.kv_checksum.is_empty()
        && payload_checksum(&block.payload[..kv_bytes(h) as usize])[..] != h.kv_checksum[..]
    {
        return Err(BlockError::ChecksumMismatch);
    }
    BlockKey::from_slice(&h.key).ok_or(BlockError::BadKeyLength)
}

/// Bytes of a block's recurrent snapshots, at the end of its payload (0 for attention-only
/// models). Call on a verified header: its sizes are known to fit.
pub fn snapshot_bytes(h: &BlockHeader) -> u64 {
    u64::from(h.recurrent_layers).saturating_mul(h.recurrent_floats.saturating_mul(4))
}

/// Bytes of a block's K/V part, before its snapshots.
pub fn kv_bytes(h: &BlockHeader) -> u64 {
    h.payload_bytes.saturating_sub(snapshot_bytes(h))
}

/// Whether `block`'s payload carries its recurrent snapshots (every whole block does; one
/// fetched with `snapshot_of_last_only` may carry its K/V part alone).
pub fn carries_snapshots(block: &Block) -> bool {
    block
        .header
        .as_ref()
        .is_some_and(|h| block.payload.len() as u64 == h.payload_bytes)
}

/// A block with its K/V part only (the payload shares the original's bytes). Blocks without
/// snapshots, or without a K/V checksum to verify the part by, come back unchanged.
pub fn without_snapshots(block: &Block) -> Block {
    let mut out = block.clone();
    if let Some(h) = &block.header
        && snapshot_bytes(h) > 0
        && h.kv_checksum.len() == 16
        && carries_snapshots(block)
    {
        out.payload = block.payload.slice(..kv_bytes(h) as usize);
    }
    out
}

/// Checks a block that came with its K/V part only: the header as `verify` does, the part's
/// size and its own checksum. Returns its key.
pub fn verify_kv_part(block: &Block) -> Result<BlockKey, BlockError> {
    let h = block.header.as_ref().ok_or(BlockError::NoHeader)?;
    verify_header(h)?;
    let got = block.payload.len() as u64;
    if got != kv_bytes(h) {
        return Err(BlockError::SizeMismatch {
            got,
            declared: kv_bytes(h),
        });
    }
    if h.kv_checksum.len() != 16 || payload_checksum(&block.payload)[..] != h.kv_checksum[..] {
        return Err(BlockError::ChecksumMismatch);
    }
    BlockKey::from_slice(&h.key).ok_or(BlockError::BadKeyLength)
}

/// The header's own consistency: version, key chain, layout vs size.
pub fn verify_header(h: &BlockHeader) -> Result<(), BlockError> {
    if h.format_version != FORMAT_VERSION {
        return Err(BlockError::Version(h.format_version));
    }
    if h.namespace.is_empty() {
        return Err(BlockError::NoNamespace);
    }
    let key = BlockKey::from_slice(&h.key).ok_or(BlockError::BadKeyLength)?;
    let parent = if h.parent.is_empty() {
        None
    } else {
        Some(BlockKey::from_slice(&h.parent).ok_or(BlockError::BadKeyLength)?)
    };
    if BlockKey::chain(&h.namespace, parent.as_ref(), &h.token_ids) != key {
        return Err(BlockError::KeyMismatch);
    }
    let elem = dtype_bytes(&h.dtype).ok_or_else(|| BlockError::Dtype(h.dtype.clone()))?;
    let values = [
        u64::from(h.num_layers),
        u64::from(h.kv_heads),
        u64::from(h.head_dim),
        h.token_ids.len() as u64,
    ]
    .into_iter()
    .try_fold(2u64, u64::checked_mul);
    // Checked: the header comes from a file or the network; a size past u64 is a mismatch,
    // not a panic or a wrapped number that could happen to match.
    let expected = match h.kv_quant.as_str() {
        "" => values.and_then(|v| v.checked_mul(elem)),
        "f16" => values.and_then(|v| v.checked_mul(2)),
        scheme => {
            let bits = quant_bits(scheme).ok_or_else(|| BlockError::Quant(scheme.to_string()))?;
            if h.head_dim == 0 || u64::from(h.head_dim) % QUANT_GROUP != 0 {
                return Err(BlockError::Quant(format!(
                    "{scheme} with head_dim {}",
                    h.head_dim
                )));
            }
            // Per group: f32 scale and minimum, then the codes.
            values.and_then(|v| (v / QUANT_GROUP).checked_mul(8 + QUANT_GROUP * bits / 8))
        }
    };
    // Hybrid models' blocks end with a snapshot of each recurrent layer's state (f32).
    let snapshot = h
        .recurrent_floats
        .checked_mul(4)
        .and_then(|f| u64::from(h.recurrent_layers).checked_mul(f));
    let expected = match (expected, h.recurrent_layers) {
        (e, 0) if h.recurrent_floats == 0 => e,
        (Some(e), _) if h.kv_quant.is_empty() => snapshot.and_then(|s| e.checked_add(s)),
        _ => None,
    };
    let attention = h.num_layers as usize;
    let kinds_ok = h.layer_kinds.len() == attention + h.recurrent_layers as usize
        && h.layer_kinds.iter().enumerate().all(|(i, &k)| {
            let kind = if i < attention {
                StateKind::FullAttentionKv
            } else {
                StateKind::Recurrent
            };
            k == kind as i32
        });
    let too_many = h.block_tokens != 0 && h.token_ids.len() > h.block_tokens as usize;
    if !kinds_ok || expected != Some(h.payload_bytes) || h.token_ids.is_empty() || too_many {
        return Err(BlockError::LayoutMismatch {
            declared: h.payload_bytes,
            expected: expected.unwrap_or(u64::MAX),
        });
    }
    if h.payload_checksum.len() != 16 || !matches!(h.kv_checksum.len(), 0 | 16) {
        return Err(BlockError::ChecksumMismatch);
    }
    Ok(())
}

/// True for a partial (tail) block: fewer tokens than its namespace's block size.
pub fn is_partial(h: &BlockHeader) -> bool {
    h.block_tokens != 0 && (h.token_ids.len() as u32) < h.block_tokens
}

/// How a held block may continue a prompt past the whole blocks held for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Continuation {
    /// A partial block (fewer than `block_tokens` tokens) whose tokens all start the rest: the
    /// block-granular rule of `cache.exact`, under which hits are bit-identical.
    WholePartial { block_tokens: usize },
    /// Any block, full or partial, by its longest common prefix with the rest: its leading
    /// rows are the KV of those tokens at those positions (the default).
    CommonPrefix,
}

impl Continuation {
    /// How many leading tokens of `tail` a block holding `stored` gives (0: none).
    pub fn rows(self, stored: &[u32], tail: &[u32]) -> usize {
        match self {
            Continuation::WholePartial { block_tokens } => {
                let whole = stored.len() < block_tokens && tail.starts_with(stored);
                if whole { stored.len() } else { 0 }
            }
            Continuation::CommonPrefix => {
                stored.iter().zip(tail).take_while(|(a, b)| a == b).count()
            }
        }
    }
}

/// The parent under which a chain's first block hangs, per namespace.
pub fn root_of(namespace: &str) -> BlockKey {
    BlockKey::chain(namespace, None, &[])
}

/// Magic at the start of every block file.
pub const FILE_MAGIC: &[u8; 8] = b"STKVBLK1";

/// A block as one file: magic, header length (u32 LE), encoded header, payload. The service
/// writes these; callers with file reads (FetchRequest.file_reads) read them directly.
pub fn encode_file_prefix(block: &Block) -> Vec<u8> {
    let header = block
        .header
        .as_ref()
        .map(|h| h.encode_to_vec())
        .unwrap_or_default();
    let mut v = Vec::with_capacity(FILE_MAGIC.len() + 4 + header.len());
    v.extend_from_slice(FILE_MAGIC);
    v.extend_from_slice(&(header.len() as u32).to_le_bytes());
    v.extend_from_slice(&header);
    v
}

/// Parses a block file (without verifying it: see `verify`). The payload shares `bytes`.
pub fn decode_file(bytes: Bytes) -> Result<Block, String> {
    let rest = bytes.strip_prefix(FILE_MAGIC).ok_or("bad magic")?;
    let len = rest
        .get(..4)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map(u32::from_le_bytes)
        .ok_or("truncated")? as usize;
    let header = rest.get(4..4 + len).ok_or("truncated header")?;
    let header = BlockHeader::decode(header).map_err(|e| format!("header: {e}"))?;
    let start = FILE_MAGIC.len() + 4 + len;
    Ok(Block {
        header: Some(header),
        payload: bytes.slice(start..),
        file: None,
    })
}

/// Reads a block file and checks it is the block `key` names, whole and unaltered.
pub fn read_file_verified(path: &std::path::Path, key: &BlockKey) -> Result<Block, FileReadError> {
    let bytes = std::fs::read(path).map_err(FileReadError::Io)?;
    let block = decode_file(Bytes::from(bytes)).map_err(FileReadError::Corrupt)?;
    match verify(&block) {
        Ok(k) if k == *key => Ok(block),
        Ok(_) => Err(FileReadError::Corrupt("file holds another block".into())),
        Err(e) => Err(FileReadError::Corrupt(e.to_string())),
    }
}

/// Reads the K/V part of a hybrid model's block file, without its snapshots, and checks it
/// is the block `key` names with that part unaltered (its `kv_checksum`). A block without
/// snapshots, or written before K/V checksums, is read and verified whole.
pub fn read_file_kv_verified(
    path: &std::path::Path,
    key: &BlockKey,
) -> Result<Block, FileReadError> {
    use std::io::{Read, Seek, SeekFrom};
    let corrupt = |why: &str| FileReadError::Corrupt(why.to_string());
    let mut file = std::fs::File::open(path).map_err(FileReadError::Io)?;
    let mut lead = [0u8; FILE_MAGIC.len() + 4];
    file.read_exact(&mut lead)
        .map_err(|_| corrupt("truncated"))?;
    if &lead[..FILE_MAGIC.len()] != FILE_MAGIC {
        return Err(corrupt("bad magic"));
    }
    let mut len = [0u8; 4];
    len.copy_from_slice(&lead[FILE_MAGIC.len()..]);
    let len = u32::from_le_bytes(len) as usize;
    // A header is a few KB (token ids and layer kinds); a larger length is a damaged file,
    // not an allocation to make.
    if len > 1 << 24 {
        return Err(corrupt("header length out of range"));
    }
    let mut header = vec![0u8; len];
    file.read_exact(&mut header)
        .map_err(|_| corrupt("truncated header"))?;
    let header = BlockHeader::decode(&header[..])
        .map_err(|e| FileReadError::Corrupt(format!("header: {e}")))?;
    if snapshot_bytes(&header) == 0 || header.kv_checksum.is_empty() {
        drop(file);
        return read_file_verified(path, key).map(|b| without_snapshots(&b));
    }
    verify_header(&header).map_err(|e| FileReadError::Corrupt(e.to_string()))?;
    let mut payload = vec![0u8; kv_bytes(&header) as usize];
    file.seek(SeekFrom::Start((lead.len() + len) as u64))
        .map_err(FileReadError::Io)?;
    file.read_exact(&mut payload)
        .map_err(|_| corrupt("truncated payload"))?;
    let block = Block {
        header: Some(header),
        payload: Bytes::from(payload),
        file: None,
    };
    match verify_kv_part(&block) {
        Ok(k) if k == *key => Ok(block),
        Ok(_) => Err(corrupt("file holds another block")),
        Err(e) => Err(FileReadError::Corrupt(e.to_string())),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FileReadError {
    #[error("{0}")]
    Io(std::io::Error),
    #[error("corrupt block file: {0}")]
    Corrupt(String),
}

/// Builds a valid full block (used by clients and tests).
pub fn make_block(
    namespace: &str,
    parent: Option<&BlockKey>,
    token_ids: Vec<u32>,
    layout: (u32, u32, u32, &str),
    payload: Vec<u8>,
) -> Block {
    let block_tokens = token_ids.len() as u32;
    make_block_of(namespace, parent, token_ids, block_tokens, layout, payload)
}

/// Builds a valid block of a namespace whose blocks hold `block_tokens` tokens; with fewer
/// token ids it is a partial block.
pub fn make_block_of(
    namespace: &str,
    parent: Option<&BlockKey>,
    token_ids: Vec<u32>,
    block_tokens: u32,
    layout: (u32, u32, u32, &str),
    payload: Vec<u8>,
) -> Block {
    let (num_layers, kv_heads, head_dim, dtype) = layout;
    let key = BlockKey::chain(namespace, parent, &token_ids);
    Block {
        header: Some(BlockHeader {
            format_version: FORMAT_VERSION,
            namespace: namespace.to_string(),
            key: key.0.to_vec(),
            parent: parent.map(|p| p.0.to_vec()).unwrap_or_default(),
            token_ids,
            num_layers,
            dtype: dtype.to_string(),
            kv_heads,
            head_dim,
            layer_kinds: vec![StateKind::FullAttentionKv as i32; num_layers as usize],
            payload_bytes: payload.len() as u64,
            payload_checksum: payload_checksum(&payload).to_vec(),
            block_tokens,
            kv_quant: String::new(),
            recurrent_layers: 0,
            recurrent_floats: 0,
            kv_checksum: Vec::new(),
        }),
        payload: Bytes::from(payload),
        file: None,
    }
}

/// Marks `block` (made by `make_block_of` with a payload that ends with the snapshots) as a
/// hybrid model's: `layers` recurrent layers of `floats` f32 values each after its K/V, whose
/// part before them gets its own checksum.
pub fn with_recurrent_state(mut block: Block, layers: u32, floats: u64) -> Block {
    if let Some(h) = block.header.as_mut() {
        h.recurrent_layers = layers;
        h.recurrent_floats = floats;
        let kv = (block.payload.len() as u64).saturating_sub(snapshot_bytes(h)) as usize;
        h.kv_checksum = payload_checksum(&block.payload[..kv]).to_vec();
        h.layer_kinds.extend(std::iter::repeat_n(
            StateKind::Recurrent as i32,
            layers as usize,
        ));
    }
    block
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(tokens: Vec<u32>, parent: Option<&BlockKey>) -> Block {
        let n = tokens.len();
        make_block(
            "ns",
            parent,
            tokens,
            (2, 1, 4, "float32"),
            vec![7u8; 2 * 2 * 4 * 4 * n],
        )
    }

    #[test]
    fn quantised_payloads_are_checked_against_their_scheme() {
        // 2 layers x K/V x 1 head x 2 tokens = 8 rows of 64 values; 8-bit: 8 x (8 + 64) bytes.
        let mut b = make_block_of(
            "ns",
            None,
            vec![1, 2],
            4,
            (2, 1, 64, "float32"),
            vec![3u8; 576],
        );
        let set = |b: &mut Block, scheme: &str| {
            if let Some(h) = b.header.as_mut() {
                h.kv_quant = scheme.to_string();
            }
        };
        // Read as full precision it is the wrong size: never served as f32.
        assert!(matches!(verify(&b), Err(BlockError::LayoutMismatch { .. })));
        set(&mut b, "affine-q8-g64");
        assert!(verify(&b).is_ok());
        set(&mut b, "affine-q4-g64");
        assert!(matches!(verify(&b), Err(BlockError::LayoutMismatch { .. })));
        set(&mut b, "f16");
        assert!(matches!(verify(&b), Err(BlockError::LayoutMismatch { .. })));
        set(&mut b, "affine-q3-g64");
        assert!(matches!(verify(&b), Err(BlockError::Quant(_))));
        // A head size the groups do not divide.
        let mut odd = make_block_of(
            "ns",
            None,
            vec![1],
            4,
            (1, 1, 48, "float32"),
            vec![0u8; 144],
        );
        set(&mut odd, "affine-q8-g64");
        assert!(matches!(verify(&odd), Err(BlockError::Quant(_))));
    }

    #[test]
    fn chain_keys_depend_on_namespace_parent_and_tokens() {
        let a = BlockKey::chain("m1", None, &[1, 2, 3]);
        assert_eq!(a, BlockKey::chain("m1", None, &[1, 2, 3]));
        assert_ne!(a, BlockKey::chain("m2", None, &[1, 2, 3]));
        assert_ne!(a, BlockKey::chain("m1", None, &[1, 2, 4]));
        let b = BlockKey::chain("m1", Some(&a), &[4, 5]);
        assert_ne!(b, BlockKey::chain("m1", None, &[4, 5]));
        // No ambiguity between namespace bytes and token bytes.
        assert_ne!(
            BlockKey::chain("m", None, &[0x31]),
            BlockKey::chain("m1", None, &[])
        );
    }

    #[test]
    fn a_valid_block_verifies_and_every_lie_is_caught() {
        let root = block(vec![1, 2], None);
        let key = verify(&root).unwrap();
        verify(&block(vec![3], Some(&key))).unwrap();

        let mut b = root.clone();
        let mut bad = b.payload.to_vec();
        bad[5] ^= 1;
        b.payload = bad.into();
        assert_eq!(verify(&b), Err(BlockError::ChecksumMismatch));
        let mut b = root.clone();
        b.header.as_mut().unwrap().token_ids[0] = 9;
        assert_eq!(verify(&b), Err(BlockError::KeyMismatch));
        let mut b = root.clone();
        b.payload.truncate(b.payload.len() - 1);
        assert!(matches!(verify(&b), Err(BlockError::SizeMismatch { .. })));
        let mut b = root.clone();
        b.header.as_mut().unwrap().kv_heads = 2;
        assert!(matches!(verify(&b), Err(BlockError::LayoutMismatch { .. })));
        let mut b = root.clone();
        // A block of the previous format (BLAKE3 checksums) is refused by its version.
        b.header.as_mut().unwrap().format_version = 1;
        assert_eq!(verify(&b), Err(BlockError::Version(1)));
        let mut b = root.clone();
        let h = b.header.as_mut().unwrap();
        h.payload_checksum = blake3::hash(&b.payload).as_bytes().to_vec();
        assert_eq!(verify(&b), Err(BlockError::ChecksumMismatch));
        let mut b = root.clone();
        b.header.as_mut().unwrap().payload_checksum[15] ^= 1;
        assert_eq!(verify(&b), Err(BlockError::ChecksumMismatch));
        // A layout whose size does not fit in u64 is a mismatch, not an overflow.
        let mut b = root;
        let h = b.header.as_mut().unwrap();
        (h.num_layers, h.kv_heads, h.head_dim) = (u32::MAX, u32::MAX, u32::MAX);
        h.payload_bytes = u64::MAX;
        assert!(matches!(
            verify_header(h),
            Err(BlockError::LayoutMismatch { .. })
        ));
    }

    #[test]
    fn a_hybrid_block_carries_its_recurrent_snapshots_after_the_kv() {
        // Two attention layers of one head of 4 f32 values, three tokens; three recurrent
        // layers of five floats.
        let kv = 2 * 2 * 4 * 3 * 4;
        let snapshots = 3 * 5 * 4;
        let made = |payload: usize| {
            let block = make_block_of(
                "ns",
                None,
                vec![1, 2, 3],
                4,
                (2, 1, 4, "float32"),
                vec![3u8; payload],
            );
            with_recurrent_state(block, 3, 5)
        };
        let hybrid = made(kv + snapshots);
        assert_eq!(verify(&hybrid).map(|_| ()), Ok(()));
        let h = hybrid.header.as_ref().unwrap();
        assert_eq!(h.layer_kinds.len(), 5);
        // The K/V alone, a snapshot short, kinds out of order, or unmarked: refused.
        assert!(matches!(
            verify(&made(kv)),
            Err(BlockError::LayoutMismatch { .. })
        ));
        assert!(matches!(
            verify(&made(kv + snapshots - 4)),
            Err(BlockError::LayoutMismatch { .. })
        ));
        let mut swapped = hybrid.clone();
        swapped.header.as_mut().unwrap().layer_kinds.swap(0, 4);
        assert!(matches!(
            verify_header(swapped.header.as_ref().unwrap()),
            Err(BlockError::LayoutMismatch { .. })
        ));
        let plain = make_block_of(
            "ns",
            None,
            vec![1, 2, 3],
            4,
            (2, 1, 4, "float32"),
            vec![3u8; kv + snapshots],
        );
        assert!(matches!(
            verify(&plain),
            Err(BlockError::LayoutMismatch { .. })
        ));
    }

    /// A hybrid block with distinct bytes in its K/V part and its snapshots, written to a
    /// block file in `dir`.
    fn hybrid_file(dir: &std::path::Path) -> (Block, std::path::PathBuf, usize) {
        let kv = 2 * 2 * 4 * 3 * 4;
        let payload: Vec<u8> = (0..kv + 3 * 5 * 4).map(|i| i as u8).collect();
        let block = with_recurrent_state(
            make_block_of("ns", None, vec![1, 2, 3], 4, (2, 1, 4, "float32"), payload),
            3,
            5,
        );
        let path = dir.join("b.blk");
        let mut file = encode_file_prefix(&block);
        file.extend_from_slice(&block.payload);
        std::fs::write(&path, file).unwrap();
        (block, path, kv)
    }

    #[test]
    fn the_kv_part_of_a_hybrid_block_is_read_and_verified_without_its_snapshots() {
        let dir = tempfile::tempdir().unwrap();
        let (block, path, kv) = hybrid_file(dir.path());
        let key = verify(&block).unwrap();
        let part = read_file_kv_verified(&path, &key).unwrap();
        assert_eq!(part.payload, block.payload.slice(..kv));
        assert_eq!(part.header, block.header);
        assert!(!carries_snapshots(&part));
        assert_eq!(verify_kv_part(&part), Ok(key));
        assert_eq!(without_snapshots(&block).payload, part.payload);
        // The part is not a whole block, and a whole block is not a part.
        assert!(matches!(
            verify(&part),
            Err(BlockError::SizeMismatch { .. })
        ));
        assert!(matches!(
            verify_kv_part(&block),
            Err(BlockError::SizeMismatch { .. })
        ));
        // Another key, or a K/V byte altered on disk: refused. A snapshot byte altered does
        // not touch the K/V part, which stays good; a whole read catches it.
        let other = BlockKey::chain("ns", None, &[9]);
        assert!(read_file_kv_verified(&path, &other).is_err());
        let clean = std::fs::read(&path).unwrap();
        let start = clean.len() - block.payload.len();
        let mut bytes = clean.clone();
        bytes[start + 5] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert!(matches!(
            read_file_kv_verified(&path, &key),
            Err(FileReadError::Corrupt(_))
        ));
        let mut bytes = clean.clone();
        bytes[start + kv + 2] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(
            read_file_kv_verified(&path, &key).unwrap().payload,
            part.payload
        );
        assert!(read_file_verified(&path, &key).is_err());
        // A file cut inside its K/V part, or with a header length past any header.
        std::fs::write(&path, &clean[..start + kv - 1]).unwrap();
        assert!(read_file_kv_verified(&path, &key).is_err());
        let mut bytes = clean.clone();
        bytes[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        std::fs::write(&path, &bytes).unwrap();
        assert!(read_file_kv_verified(&path, &key).is_err());
    }

    #[test]
    fn a_kv_checksum_that_disagrees_with_the_payload_is_refused_and_old_blocks_read_whole() {
        let dir = tempfile::tempdir().unwrap();
        let (block, path, kv) = hybrid_file(dir.path());
        let mut lying = block.clone();
        lying.header.as_mut().unwrap().kv_checksum[0] ^= 1;
        assert_eq!(verify(&lying), Err(BlockError::ChecksumMismatch));
        let mut short = block.clone();
        short.header.as_mut().unwrap().kv_checksum.truncate(8);
        assert_eq!(verify(&short), Err(BlockError::ChecksumMismatch));
        // A block written before K/V checksums: its part cannot be checked alone, so it is
        // read whole, verified, then cut.
        let mut old = block.clone();
        old.header.as_mut().unwrap().kv_checksum.clear();
        let key = verify(&old).unwrap();
        assert_eq!(without_snapshots(&old).payload.len(), old.payload.len());
        let mut file = encode_file_prefix(&old);
        file.extend_from_slice(&old.payload);
        std::fs::write(&path, file).unwrap();
        let part = read_file_kv_verified(&path, &key).unwrap();
        assert_eq!(part.payload.len(), old.payload.len());
        assert!(carries_snapshots(&part));
        assert!(kv < part.payload.len());
    }
}
